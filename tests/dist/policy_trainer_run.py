"""For each layout, build a PolicyTrainer on this torchrun world, score a fixed batch, take
one step, save results: several layouts share one launch.

    torchrun --nproc_per_node 2 tests/dist/policy_trainer_run.py OUT_DIR \
        [MODEL:]MICRO,ACTIVATION_CHECKPOINT,TP[,REPLICATE] [MICRO,ACTIVATION_CHECKPOINT,TP ...]

MODEL (default the tiny Qwen3) names another tiny model: qwen3_5 (its Gated DeltaNet layers),
or moe (the tiny Qwen3-MoE, its experts split over the world: parallelism.ep = world size).
MICRO is a count of padded micro-batches (training.micro_batch_tokens = 0) or bN, packed
micro-batches of at most N tokens. REPLICATE (default 1) is HSDP's replica count
(parallelism.dp_replicate; FSDP shards over the world / (REPLICATE x TP) ranks of each). Each
layout's results go to OUT_DIR/[{MODEL}_]{MICRO}_{ACTIVATION_CHECKPOINT}_tp{TP}[_r{REPLICATE}].pt. Each
data-parallel rank trains on its contiguous share of the same 8-sequence batch (the ranks
of a TP group on the same share; packed layouts on 2 data-parallel ranks start from uneven
shares, 6 and 2 rows). Rank 0 saves the logprobs of the whole batch (before the
step), the pre-update logprobs the step itself reports for its share, the model forwards the
step ran on every rank (their token shapes), and the full parameters before and after it, so
tests can compare world sizes, micro-batch counts and packing, parallelisms and activation
checkpointing. It also saves the gradients the
optimizer applied, and every rank's host reads in the step, in order. With 2 ranks it also compares the vocabulary-parallel head (trainer TP)
with the whole head on random tensors: OUT_DIR/head.pt (`vocabulary_parallel_head`).
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers.batches import fixed_batch, pg_loss, recorded_grads
from helpers.host_syncs import HostSyncs
from helpers.launch import REPO, TINY
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from torchtitan_rl import platform
from torchtitan_rl.config import ModelSection, ParallelismSection, TrainingSection
from torchtitan_rl.trainer import logprobs
from torchtitan_rl.trainer.logprobs import head_weight
from torchtitan_rl.trainer.policy_trainer import PolicyTrainer


# The head comparison: each of 2 ranks holds its rows of a 51-entry vocabulary (26 and 25:
# Shard(0)'s uneven split); the hidden states are the same on both.
VOCAB, DIM, TOKENS, CHUNK, TEMPERATURE = 51, 16, 37, 8, 0.7


def main() -> None:
    out = Path(sys.argv[1])
    platform.patch_torchtitan()
    rank, world = platform.init_distributed()
    for layout in sys.argv[2:]:
        name, _, layout = layout.rpartition(":")
        micro, checkpointing, tp, *replicate = layout.split(",")
        replicas = int(replicate[0]) if replicate else 1
        model, ep = ModelSection(hf_checkpoint=TINY), 1
        if name == "moe":  # the tiny Qwen3-MoE, its experts over the world (EP)
            tiny_moe = str(REPO / "assets" / "tiny_moe_qwen3")
            model, ep = ModelSection(flavor="tiny_moe", hf_checkpoint=tiny_moe), world
        elif name:
            model = ModelSection(
                name=name, flavor="tiny", hf_checkpoint=str(REPO / "assets" / f"tiny_{name}")
            )
        result = step(model, micro, checkpointing, int(tp), rank, world, replicas, ep)
        if rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            prefix, suffix = f"{name}_" if name else "", f"_r{replicas}" if replicate else ""
            torch.save(result, out / f"{prefix}{micro}_{checkpointing}_tp{tp}{suffix}.pt")
    if world == 2:
        result = vocabulary_parallel_head(rank, world)
        if rank == 0:
            torch.save(result, out / "head.pt")
    platform.shutdown_distributed()


def step(
    model: ModelSection,
    micro: str,
    checkpointing: str,
    tp: int,
    rank: int,
    world: int,
    replicas: int = 1,
    ep: int = 1,
) -> dict:
    """One layout's trainer: score, one step; what rank 0 saves (every rank must call it)."""
    packed = micro.startswith("b")
    trainer = PolicyTrainer(
        model=model,
        training=TrainingSection(
            lr=1e-2,
            micro_batches=1 if packed else int(micro),
            micro_batch_tokens=int(micro[1:]) if packed else 0,
            max_grad_norm=0.0,
            activation_checkpoint=checkpointing,
        ),
        parallelism=ParallelismSection(tp=tp, dp_replicate=replicas, ep=ep),
        temperature=0.7,
    )
    batch = fixed_batch()
    logprobs_BT, entropy_BT = trainer.logprobs(batch.tokens_BT)
    dp_size, dp_rank = world // tp, rank // tp  # torchtitan puts TP innermost
    rows = torch.arange(batch.batch_size).tensor_split(dp_size)[dp_rank]
    if packed and dp_size == 2:
        # Uneven shares (51 and 13 tokens to run): the step must deal rows between the ranks.
        rows = torch.arange(6) if dp_rank == 0 else torch.arange(6, 8)
    local = batch.rows(rows)

    forwards, head_calls = [], []
    trainer.model.register_forward_hook(lambda _, args, __: forwards.append(tuple(args[0].shape)))
    # The fused head runs as a call of the lm_head module, inside FSDP's hooks.
    trainer.model.lm_head.register_forward_hook(lambda *_: head_calls.append(1))

    before = {k: p.full_tensor().clone() for k, p in trainer.named_parameters().items()}
    with recorded_grads(trainer) as grads, HostSyncs() as syncs:
        result = trainer.optimizer_step(local, pg_loss)
    head = trainer.model.lm_head.weight  # FSDP swaps the sharded parameter back at reshard
    head_after_step = (type(head).__name__, tuple(getattr(head, "_local_tensor", head).shape))
    after = {k: p.full_tensor() for k, p in trainer.named_parameters().items()}
    state = trainer.state_dict()  # collective: every rank calls it
    # A MoE model's state holds plain tensors too (its routers' load-balancing buffers).
    params = {k: getattr(v, "full_tensor", lambda v=v: v)() for k, v in state.items()}
    local_shapes = {k: tuple(getattr(v, "_local_tensor", v).shape) for k, v in state.items()}
    live = {
        name.replace("_checkpoint_wrapped_module.", ""): param
        for name, param in trainer.model.named_parameters()
    }
    weight, head_group, _ = head_weight(trainer.model.lm_head)  # the packed path's head
    params_are_views = all(
        p is live[k] and type(p).__name__ == "DTensor"
        for k, p in trainer.named_parameters().items()
    )
    return {
        "logprobs_BT": logprobs_BT,
        "entropy_BT": entropy_BT,
        # Keyed as the gradients (the trained parameters' names).
        "weights_before": before,
        "weights_after": after,
        "params": params,
        "grads": grads,
        "metrics": result.metrics,
        "step_logprobs_BT": result.logprobs_BT,
        "share": (dp_rank, dp_size),
        "rows": rows,
        "forwards": platform.all_gather_objects(forwards),
        # Every rank's reads in the step, in order (tests/helpers/host_syncs.py).
        "host_reads": platform.all_gather_objects(syncs.calls),
        "library_reads": platform.all_gather_objects(syncs.library),
        "checkpointed_blocks": sum(
            isinstance(m, CheckpointWrapper) for m in trainer.model.modules()
        ),
        "local_shapes": local_shapes,
        "params_are_views": params_are_views,
        "head_rows": weight.shape[0],
        "head_calls": len(head_calls),
        "head_after_step": head_after_step,
        "head_parallel": head_group is not None,
    }


def vocabulary_parallel_head(rank: int, world: int) -> dict:
    """Both heads' logprobs, entropies and gradients (the weight's gathered from both ranks'
    rows), and the widest block of logits each built."""
    torch.manual_seed(0)  # the same tensors on both ranks
    hidden_ND = torch.randn(TOKENS, DIM)
    weight_VD = torch.randn(VOCAB, DIM)
    targets_N = torch.randint(0, VOCAB, (TOKENS,))
    coefficients_N = torch.randn(TOKENS)  # a loss that weighs every token differently

    widths = []
    linear = F.linear

    def recording(x, w, *rest):
        widths.append(w.shape[0])
        return linear(x, w, *rest)

    rows = -(-VOCAB // world)
    first = rank * rows
    result = {}
    logprobs.F.linear = recording  # torch.nn.functional's, put back below
    for name, group, mine in (
        ("whole", None, slice(None)),
        ("parallel", dist.group.WORLD, slice(first, first + rows)),
    ):
        widths.clear()
        hidden = hidden_ND.clone().requires_grad_()
        weight = weight_VD[mine].clone().requires_grad_()
        logp_N, entropy_N = logprobs.head_logprobs(
            hidden, weight, targets_N, TEMPERATURE, chunk=CHUNK, group=group, first=first
        )
        (logp_N * coefficients_N).sum().backward()
        pieces = [torch.zeros(rows, DIM) for _ in range(world)] if group else None
        if group:
            padded = torch.zeros(rows, DIM)
            padded[: weight.grad.shape[0]] = weight.grad
            dist.all_gather(pieces, padded)
        result[name] = {
            "logprobs": logp_N.detach(),
            "entropy": entropy_N,
            "grad_hidden": hidden.grad,
            "grad_weight": torch.cat(pieces)[:VOCAB] if group else weight.grad,
            "widest_logits": max(widths),
        }
    logprobs.F.linear = linear
    return result


if __name__ == "__main__":
    main()
    platform.exit_process(0)
