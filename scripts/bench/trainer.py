"""Benchmark PolicyTrainer.optimizer_step: against a plain torchtitan step on uniform lengths, or
packed against padded micro-batches on a long-tailed mix of lengths.

    .venv/bin/torchrun --standalone --nproc_per_node 2 scripts/bench/trainer.py --flavor tiny
    .venv/bin/torchrun --standalone --nproc_per_node 2 scripts/bench/trainer.py \
        --flavor debugmodel_moe --ep 2 --batch 4 --steps 5
    .venv/bin/torchrun --standalone --nproc_per_node 2 scripts/bench/trainer.py \
        --model deepseek_v3 --flavor debugmodel --ep 2 --batch 4 --steps 8
    .venv/bin/python scripts/bench/trainer.py --lengths longtail --ac full --steps 2 --warmup 0
    .venv/bin/python scripts/bench/trainer.py --lengths longtail --flavor 0.6B --sequences 4 \
        --max_completion 2048 --steps 1 --warmup 0 --ac full

Uniform (under torchrun): both sides use the trainer's FSDP-sharded model and torchtitan
optimizer: "plain" is forward, torchtitan's `cross_entropy_loss`, backward, grad clipping,
optimizer and LR-scheduler step; "ours" is `optimizer_step` (packed, the default) with a
token-mean policy-gradient loss. Steps alternate between the two so machine noise hits both
alike. Rank 0 prints one JSON line: median tokens/s of each, `ratio` = ours / plain.

Long tail (run with python; it launches one 2-rank torchrun world per path, watched for
memory): a seeded mix of `--sequences` sequences, prompts uniform in 64-640 tokens,
completions lognormal with median 200 and 5% above 1,500 (sigma 1.225), capped at
`--max_completion`. Each rank holds a contiguous share, as it would the samples of its own
prompts. "padded" is the path before packing (`training.micro_batch_tokens = 0`): the share
right-padded to its longest, full logits; "packed" is `optimizer_step` under `--budget` tokens:
it redeals rows over the ranks by tokens, packs them, runs the LM head at scored tokens only.
Prints one JSON line: real (non-padding) tokens/s of each path (median step),
`speedup` = packed / padded, each path's rank token loads and `load_imbalance` (max / min),
peak RSS per rank and of the whole tree, `peak_rss_ratio` = packed / padded (per-rank maxima),
and what the paths do not change: the peak of building the trainer
(`built_peak_rss_gib_per_rank`) and the gradients and AdamW moments a step adds
(`grad_adam_gib_per_rank`, 3x the rank's parameter shard); `transient_rss_ratio` is the
packed / padded ratio of the rest (`transient_gib`: activations, logits, temporaries);
a path that ran the machine out of memory (available < `--min_free_gib`) reports
`completed: false`, and a line on stderr says so. On a 24 GiB machine the padded path at
debugmodel fits with `--ac full` only (the figure docs/trainer_and_generator.md quotes).
The long tail's default flavor is debugmodel; a flavor with fewer positions than the mix's
longest sequence is refused in one line.
"""

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from children import REPO, MemoryWatch, peak_rss_gib, report, run_child
from torchtitan.components.loss import cross_entropy_loss
from torchtitan.distributed import utils as dist_utils

from torchtitan_rl import platform
from torchtitan_rl.checkpoint import save_bytes
from torchtitan_rl.config import ModelSection, ParallelismSection, TrainingSection
from torchtitan_rl.trainer import packing
from torchtitan_rl.trainer.policy_trainer import PolicyTrainer
from torchtitan_rl.types import LossScale, RolloutBatch

TOKENIZER = REPO / "assets" / "tiny_qwen3"
# The completion-length distribution: median 200 tokens, P(> 1,500) = 5%.
MEDIAN, SIGMA = 200, math.log(1500 / 200) / 1.645


def pg_loss(logprobs_BT: torch.Tensor, batch: RolloutBatch, scale: LossScale):
    weighted_BT = batch.advantages_B[:, None] * logprobs_BT * batch.loss_mask_BT
    return -weighted_BT.sum() / scale.tokens, {}


def plain_step(trainer: PolicyTrainer, tokens_BT: torch.Tensor, max_norm: float) -> None:
    tokens_BT = tokens_BT.to(platform.device())  # (the trainer's own step moves its batch)
    positions_BT = torch.arange(tokens_BT.shape[1], device=tokens_BT.device).expand_as(tokens_BT)
    logits_BTV = trainer.model(tokens_BT, positions=positions_BT)
    loss = cross_entropy_loss(logits_BTV[:, :-1], tokens_BT[:, 1:]) / tokens_BT[:, 1:].numel()
    loss.backward()
    dist_utils.clip_grad_norm_(
        list(trainer.model.parameters()),
        max_norm=max_norm,
        ep_enabled=trainer.parallel_dims.ep_enabled,
    )
    trainer.optimizers.step()
    trainer.lr_schedulers.step()
    trainer.optimizers.zero_grad()


def build_trainer(args, micro_batch_tokens: int) -> PolicyTrainer:
    tiny = args.flavor == "tiny"
    model = ModelSection(
        name=args.model,
        flavor=args.flavor,
        hf_checkpoint=str(TOKENIZER) if tiny else None,
        tokenizer_path=str(TOKENIZER),
    )
    training = TrainingSection(
        lr=1e-4,
        steps=10_000,
        max_grad_norm=1.0,
        micro_batch_tokens=micro_batch_tokens,
        activation_checkpoint=args.ac,
    )
    parallelism = ParallelismSection(ep=args.ep)
    return PolicyTrainer(model=model, training=training, parallelism=parallelism)


def uniform(args) -> None:
    rank, world = platform.init_distributed()
    trainer = build_trainer(args, micro_batch_tokens=args.budget)
    vocab = trainer.spec.model.vocab_size
    g = torch.Generator().manual_seed(rank)
    tokens_BT = torch.randint(0, vocab, (args.batch, args.seq), generator=g)
    batch = RolloutBatch(
        tokens_BT=tokens_BT,
        loss_mask_BT=torch.ones(args.batch, args.seq),
        advantages_B=torch.randn(args.batch, generator=g),
        generator_logprobs_BT=torch.zeros(args.batch, args.seq),
    )

    times: dict[str, list[float]] = {"ours": [], "plain": []}
    for i in range(args.warmup + args.steps):
        for kind in ("ours", "plain"):
            dist.barrier()
            start = time.perf_counter()
            if kind == "ours":
                trainer.optimizer_step(batch, pg_loss)
            else:
                plain_step(trainer, tokens_BT, 1.0)
            if torch.cuda.is_available():  # the step's kernels done, not only queued
                torch.cuda.synchronize()
            dist.barrier()
            if i >= args.warmup:
                times[kind].append(time.perf_counter() - start)

    tokens_per_step = args.batch * args.seq * world
    ours = tokens_per_step / statistics.median(times["ours"])
    plain = tokens_per_step / statistics.median(times["plain"])
    if rank == 0:
        row = {
            "bench": "trainer",
            "lengths": "uniform",
            "model": args.model,
            "flavor": args.flavor,
            "nproc": world,
            "ep": args.ep,
            "batch_per_rank": args.batch,
            "seq": args.seq,
            "tokens_per_s": round(ours, 1),
            "plain_tokens_per_s": round(plain, 1),
            "ratio": round(ours / plain, 3),
        }
        print(json.dumps(row), flush=True)
    platform.shutdown_distributed()


def longtail_mix(sequences: int, max_completion: int, seed: int) -> list[tuple[int, int]]:
    """(prompt tokens, completion tokens) of each sequence of the seeded long-tailed mix."""
    rng = random.Random(seed)
    mix = []
    for _ in range(sequences):
        completion = round(rng.lognormvariate(math.log(MEDIAN), SIGMA))
        mix.append((rng.randint(64, 640), max(1, min(max_completion, completion))))
    return mix


def rank_batch(mix: list[tuple[int, int]], rows: list[int], vocab: int, seed: int):
    """The right-padded RolloutBatch of `mix[rows]`: random ids, loss on the completions."""
    g = torch.Generator().manual_seed(seed)
    width = max(sum(mix[i]) for i in rows)
    tokens_BT = torch.zeros(len(rows), width, dtype=torch.long)
    mask_BT = torch.zeros(len(rows), width)
    for b, i in enumerate(rows):
        prompt, completion = mix[i]
        tokens_BT[b, : prompt + completion] = torch.randint(
            0, vocab, (prompt + completion,), generator=g
        )
        mask_BT[b, prompt : prompt + completion] = 1.0
    return RolloutBatch(
        tokens_BT=tokens_BT,
        loss_mask_BT=mask_BT,
        advantages_B=torch.randn(len(rows), generator=g),
        generator_logprobs_BT=torch.zeros(len(rows), width),
    )


def longtail_child(args) -> None:
    """One path (`args.path`) on the mix in this torchrun world; reports its figures."""
    rank, world = platform.init_distributed()
    packed = args.path == "packed"
    trainer = build_trainer(args, micro_batch_tokens=args.budget if packed else 0)
    mix = longtail_mix(args.sequences, args.max_completion, args.seed)
    lengths = [p + c for p, c in mix]
    # Each rank holds the samples of its own prompts, in draw order; packed, optimizer_step deals
    # them anew by tokens (PolicyTrainer._deal), which `shares` then replays.
    per_rank = math.ceil(len(mix) / world)
    shares = [list(range(len(mix)))[r * per_rank : (r + 1) * per_rank] for r in range(world)]
    batch = rank_batch(mix, shares[rank], trainer.spec.model.vocab_size, args.seed + rank)
    if packed:
        dealt = packing.rebalance([[lengths[i] for i in share] for share in shares])
        shares = [[shares[r][i] for r, i in share] for share in dealt]
    # What building the trainer peaked at (weights, allocator); a step adds the gradients and
    # AdamW's two moments (3x this rank's shard of the trained parameters, as a checkpoint
    # holds: `save_bytes`; the same on both paths) and its transient memory (activations,
    # logits), which is where the paths differ.
    built = platform.all_gather_objects(peak_rss_gib())
    state = platform.all_gather_objects(save_bytes(trainer) / 2**30)
    times = []
    for i in range(args.warmup + args.steps):
        dist.barrier()
        start = time.perf_counter()
        trainer.optimizer_step(batch, pg_loss)
        dist.barrier()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    rss = platform.all_gather_objects(peak_rss_gib())
    if rank == 0:
        report(
            {
                "step_s": statistics.median(times),
                "rank_tokens": [sum(lengths[i] for i in share) for share in shares],
                "rank_padded_tokens": [
                    len(share) * max((lengths[i] for i in share), default=0) for share in shares
                ],
                "peak_rss_gib_per_rank": [round(gib, 3) for gib in rss],
                "built_peak_rss_gib_per_rank": [round(gib, 3) for gib in built],
                "grad_adam_gib_per_rank": [round(gib, 3) for gib in state],
            }
        )
    platform.shutdown_distributed()


def longtail(args, passthrough: list[str]) -> None:
    mix = longtail_mix(args.sequences, args.max_completion, args.seed)
    completions = sorted(c for _, c in mix)
    real_tokens = sum(p + c for p, c in mix)
    row = {
        "bench": "trainer",
        "lengths": "longtail",
        "flavor": args.flavor,
        "nproc": args.nproc,
        "sequences": args.sequences,
        "budget": args.budget,
        "activation_checkpoint": args.ac,
        "real_tokens": real_tokens,
        "completion_median": completions[len(completions) // 2],
        "completion_max": completions[-1],
        "completions_over_1500": sum(c > 1500 for c in completions),
    }
    script = str(Path(__file__).resolve())
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    for path in ("packed", "padded"):
        command = [*torchrun, "--nproc_per_node", str(args.nproc), script, "--child", path]
        with tempfile.TemporaryDirectory(), MemoryWatch(args.min_free_gib) as watch:
            try:
                result = run_child([*command, *passthrough])
            except SystemExit:
                if not watch.fired:
                    raise
                result = {"completed": False, "stopped": f"available < {args.min_free_gib} GiB"}
        if "step_s" in result:
            result["tokens_per_s"] = round(real_tokens / result.pop("step_s"), 1)
            loads = result["rank_tokens"]
            result["load_imbalance"] = round(max(loads) / max(min(loads), 1), 3)
        result["tree_peak_rss_gib"] = round(watch.peak / 2**30, 3)
        row[path] = result
    packed, padded = row["packed"], row["padded"]
    for path in ("packed", "padded"):
        if row[path].get("completed") is False:
            print(
                f"trainer bench: the {path} path ran out of memory (available < "
                f"{args.min_free_gib} GiB, the tree at {row[path]['tree_peak_rss_gib']} GiB): no "
                "comparison at this size; --ac full, fewer --sequences or a lower "
                "--max_completion fit",
                file=sys.stderr,
            )
    if "tokens_per_s" in packed and "tokens_per_s" in padded:
        row["speedup"] = round(packed["tokens_per_s"] / padded["tokens_per_s"], 3)
    if "peak_rss_gib_per_rank" in packed and "peak_rss_gib_per_rank" in padded:
        ratio = max(packed["peak_rss_gib_per_rank"]) / max(padded["peak_rss_gib_per_rank"])
        row["peak_rss_ratio"] = round(ratio, 3)
        # The steps' transient memory: each rank's peak above its build peak and its gradients
        # and AdamW moments.
        transient = {
            path: max(
                peak - built - state
                for peak, built, state in zip(
                    row[path]["peak_rss_gib_per_rank"],
                    row[path]["built_peak_rss_gib_per_rank"],
                    row[path]["grad_adam_gib_per_rank"],
                    strict=True,
                )
            )
            for path in ("packed", "padded")
        }
        row["transient_gib"] = {path: round(gib, 3) for path, gib in transient.items()}
        row["transient_rss_ratio"] = round(transient["packed"] / max(transient["padded"], 1e-9), 3)
    print(json.dumps(row), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", choices=("uniform", "longtail"), default="uniform")
    parser.add_argument("--model", default="qwen3", help="uniform: the family (deepseek_v3, ...)")
    parser.add_argument(
        "--flavor",
        help="qwen3 flavor: tiny, debugmodel, 0.6B (default: tiny; longtail: debugmodel)",
    )
    parser.add_argument("--batch", type=int, default=8, help="uniform: sequences per rank")
    parser.add_argument("--seq", type=int, default=128, help="uniform: tokens per sequence")
    parser.add_argument("--sequences", type=int, default=16, help="longtail: sequences in all")
    parser.add_argument("--max_completion", type=int, default=4096, help="longtail: the cap")
    parser.add_argument("--budget", type=int, default=8192, help="packed tokens (0: padded)")
    parser.add_argument("--seed", type=int, default=0, help="longtail: the mix's seed")
    parser.add_argument("--nproc", type=int, default=2, help="longtail: ranks per world")
    parser.add_argument("--min_free_gib", type=float, default=1.5, help="longtail: stop below")
    parser.add_argument("--ac", default="none", choices=("none", "full", "selective"))
    parser.add_argument("--ep", type=int, default=1, help="expert parallel (MoE flavors)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps of each kind")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--child", choices=("packed", "padded"), dest="path")
    argv = sys.argv[1:]
    args = parser.parse_args(argv)
    if args.flavor is None:
        args.flavor = "debugmodel" if args.lengths == "longtail" else "tiny"
    if args.lengths == "longtail":
        from torchtitan_rl.models import model_spec

        positions = model_spec("qwen3", args.flavor).model.max_seq_len
        longest = max(
            p + c for p, c in longtail_mix(args.sequences, args.max_completion, args.seed)
        )
        if positions < longest:
            parser.error(
                f"--flavor {args.flavor} holds {positions} positions but the long tail's longest "
                f"sequence has {longest} tokens: use --flavor debugmodel (4,096) or a lower "
                "--max_completion"
            )
    platform.patch_torchtitan()
    if args.path is not None:
        longtail_child(args)
    elif args.lengths == "longtail":
        longtail(args, argv)
    else:
        uniform(args)


if __name__ == "__main__":
    main()
    platform.exit_process(0)
