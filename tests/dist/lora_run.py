"""A LoRA policy (FSDP over this torchrun world, batch-invariant kernels): two steps, weight
sync into a plain copy of the model, HF export.

    torchrun --nproc_per_node 2 tests/dist/lora_run.py OUT_DIR

The plain copy is the generator's side without vLLM: the same torchtitan model, unsharded,
with the batch-invariant kernels the generator runs in this mode. Rank 0 saves what the tests
assert (result.pt): which parameters train, which changed, which hold optimizer state; the
copy's weights against W + s B A merged from the gathered trainer tensors; the bytes of a first
and a later sync; the trainer's and the copy's logprobs; greedy tokens of the trainer and of
transformers on the export.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from helpers.batches import fixed_batch, pg_loss
from helpers.launch import TINY
from torch.distributed.tensor import DTensor

from torchtitan_rl import batch_invariant, platform
from torchtitan_rl.hf_export import export_policy
from torchtitan_rl.config import (
    LoRASection,
    ModelSection,
    ParallelismSection,
    TrainingSection,
)
from torchtitan_rl.trainer.logprobs import token_logprobs
from torchtitan_rl.trainer.lora import merge
from torchtitan_rl.trainer.model import build_spec
from torchtitan_rl.trainer.policy_trainer import PolicyTrainer
from torchtitan_rl.weight_sync import WeightSync

PROMPT = [5, 17, 33, 8]


def full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


class PlainCopy:
    """The generator's model without vLLM: torchtitan's plain model with this mode's kernels."""

    def __init__(self, model: ModelSection):
        self.model = build_spec(model).model.build()  # tiny: built on the host, ties kept
        batch_invariant.make_linears_invariant(self.model)

    def weights(self) -> dict[str, nn.Parameter]:
        return dict(self.model.named_parameters())

    @torch.no_grad()
    def logprobs(self, tokens_BT: torch.Tensor) -> torch.Tensor:
        positions_BT = torch.arange(tokens_BT.shape[1]).expand_as(tokens_BT)
        logits_BTV = self.model(tokens_BT, positions=positions_BT)
        return token_logprobs(logits_BTV, tokens_BT, 1.0, with_entropy=True)[0]


def main() -> None:
    out = Path(sys.argv[1])
    platform.patch_torchtitan()
    rank, world = platform.init_distributed()
    batch_invariant.enable()
    model = ModelSection(hf_checkpoint=TINY)
    trainer = PolicyTrainer(
        model=model,
        training=TrainingSection(lr=1e-2),
        parallelism=ParallelismSection(),
        lora=LoRASection(enable=True, rank=4, alpha=8.0),
    )
    params = trainer.named_parameters()
    before = {name: full(p) for name, p in params.items()}
    plain = PlainCopy(model)
    sync = WeightSync(trainer.sync_sources(), plain.weights(), bucket_mb=0.05, verify=True)
    first_bytes, _ = sync.copy(everything=True)

    batch = fixed_batch()
    share = batch.split(world)[rank]
    for _ in range(2):  # step 1 moves B only (B = 0 zeroes A's gradient), step 2 both
        trainer.optimizer_step(share, pg_loss)
    after = {name: full(p) for name, p in params.items()}
    update_bytes, _ = sync.copy(everything=False)

    expected = {}
    for name, source in trainer.sync_sources().items():
        if hasattr(source, "lora_a"):
            owner = name.removesuffix(".weight")
            expected[name] = merge(
                after[name],
                after[f"{owner}.lora_a.weight"],
                after[f"{owner}.lora_b.weight"],
                source.scale,
            )
        else:
            expected[name] = after[name]
    copy_params = plain.weights()
    optimizer = trainer.optimizers.optimizers[0]
    names_of = {id(p): name for name, p in params.items()}
    tokens_BT = batch.tokens_BT
    trainer_logprobs_BT, _ = trainer.logprobs(tokens_BT)

    hf = out / "hf"
    export_policy(trainer, model, hf)
    restored = all(torch.equal(full(p), after[name]) for name, p in params.items())
    greedy = trainer.greedy([PROMPT], max_tokens=8, stop_ids=set())[0]
    dist.barrier()
    if rank == 0:
        from transformers import AutoModelForCausalLM

        hf_model = AutoModelForCausalLM.from_pretrained(hf)
        generated = hf_model.generate(
            torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False, eos_token_id=None
        )
        result = {
            "trainable": sorted(n for n, p in params.items() if p.requires_grad),
            "changed": sorted(n for n in params if not torch.equal(before[n], after[n])),
            "with_state": sorted(names_of[id(p)] for p in optimizer.state),
            "all_names": sorted(params),
            "copy_equals_merge": {
                name: torch.equal(copy_params[name], expected[name]) for name in expected
            },
            "adapted": sorted(n for n, s in trainer.sync_sources().items() if hasattr(s, "lora_a")),
            "first_bytes": first_bytes,
            "update_bytes": update_bytes,
            "adapted_bytes": sum(
                copy_params[n].numel() * 4
                for n, s in trainer.sync_sources().items()
                if hasattr(s, "lora_a")
            ),
            "copy_bytes": sum(p.numel() * 4 for p in copy_params.values()),
            "trainer_logprobs_BT": trainer_logprobs_BT,
            "copy_logprobs_BT": plain.logprobs(tokens_BT),
            "restored_after_export": restored,
            "trainer_greedy": greedy,
            "hf_greedy": generated[0, len(PROMPT) :].tolist(),
        }
        out.mkdir(parents=True, exist_ok=True)
        torch.save(result, out / "result.pt")
    platform.shutdown_distributed()


if __name__ == "__main__":
    main()
    platform.exit_process(0)
