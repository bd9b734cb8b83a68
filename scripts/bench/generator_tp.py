"""Benchmark the generator over 2 ranks, tensor parallel (TP = 2; with --expert-parallel an MoE's
experts split between them), against one engine per rank.

    .venv/bin/python scripts/bench/generator_tp.py --checkpoint assets/debug_qwen3_L100
    .venv/bin/python scripts/bench/generator_tp.py --checkpoint assets/debug_moe_qwen3 \
        --expert-parallel

Each layout runs under torchrun with 2 ranks, on the same prompts and per-request seeds: one
engine per rank (each samples half of the prompts; with oneDNN-packed GEMMs, the default, and
with plain GEMMs, which a TP engine runs), then one engine over both ranks (both ranks sample
all of them). Per layout: `tokens_per_s` (tokens sampled by all engines / the slowest rank's
seconds), `weights_mb` (this rank's share of the weights), `peak_rss_gib` (rank 0's peak,
engine, KV cache and a trainer included), and a weight sync from an FSDP trainer: median
`sync_ms` against `memcpy_ms`, one copy of the rank's weight bytes between preallocated
buffers. Then vLLM's native model over both ranks (TP = 2, its own TP layers and collectives),
and both TP engines again eager: every engine compiles unless `_eager` (generator.enforce_eager
unset, as vLLM runs its models). The parent prints one JSON line with the TP layout's ratios to
one engine per rank and to native TP = 2, compiled and eager (`tp2_vs_native_tp2`,
`tp2_vs_native_tp2_eager`; the native engine has no weight sync, its sync figures are null).
A checkpoint variant with long-tailed completion lengths (`make_tiny_checkpoint.py
--mean_completion_tokens`, assets/debug_qwen3_L100) gives the shape of a real RL batch.
"""

import argparse
import json
import statistics
import sys
import time

from children import REPO, ensure_checkpoint, peak_rss_gib, report, run_child


def measure(args) -> dict | None:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from torchtitan_rl import platform
    from torchtitan_rl.config import (
        GeneratorParallelismSection,
        GeneratorSection,
        ModelSection,
        ParallelismSection,
        TrainingSection,
    )
    from torchtitan_rl.generator.engine import LocalGenerator
    from torchtitan_rl.trainer.policy_trainer import PolicyTrainer
    from torchtitan_rl.weight_sync import LocalTransport

    platform.patch_torchtitan()
    rank, world = platform.init_distributed()
    recipe = json.loads((REPO / args.checkpoint / "torchtitan.json").read_text())
    name, flavor = recipe["name"], recipe["flavor"]
    model = ModelSection(name=name, flavor=flavor, hf_checkpoint=args.checkpoint)
    parallelism = GeneratorParallelismSection(
        tensor_parallel_degree=args.tp, expert_parallel=args.tp > 1 and args.expert_parallel
    )
    generator = LocalGenerator(
        generator=GeneratorSection(
            max_model_len=args.max_tokens + 64,
            num_kv_blocks=args.kv_blocks,
            cpu_packed_gemm=not args.plain,
            parallelism=parallelism,
            enforce_eager=True if args.eager else None,
        ),
        model=model,
        seed=rank // args.tp,
        native=args.native,
    )
    engine, _, engines = parallelism.engine_of(rank, world)
    vocab = json.loads((REPO / args.checkpoint / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, vocab, (int(torch.randint(16, 33, (1,), generator=g)),), generator=g)
        for _ in range(args.prompts)
    ]
    share = len(prompts) // engines
    mine = [p.tolist() for p in prompts[engine * share : (engine + 1) * share]]
    seeds = [1000 + engine * share + i for i in range(share)]  # the prompt's, in any layout
    generator.generate(mine[:2], n=2, max_tokens=8, seed=seeds[:2])  # warm-up
    dist.barrier()
    start = time.perf_counter()
    completions = generator.generate(mine, n=args.samples, max_tokens=args.max_tokens, seed=seeds)
    seconds = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    platform.all_reduce_host(seconds, op=dist.ReduceOp.MAX)
    # Each engine's tokens once (its first rank's).
    tokens = torch.tensor([completions.num_tokens if rank % args.tp == 0 else 0])
    platform.all_reduce_host(tokens)

    weight_bytes = sync_ms = memcpy_ms = None
    if not args.native:  # vLLM's own model repacks its weights: nothing to sync in place
        weights = generator.weights()
        local = [w.to_local() if isinstance(w, DTensor) else w for w in weights.values()]
        weight_bytes = sum(t.numel() * t.element_size() for t in local)
        trainer = PolicyTrainer(
            model=model, training=TrainingSection(), parallelism=ParallelismSection()
        )
        sync = LocalTransport(trainer, generator, bucket_mb=64.0, verify=False)
        sync_ms, memcpy_ms = [], []
        src, dst = (torch.ones(weight_bytes, dtype=torch.uint8) for _ in range(2))
        for _ in range(args.repeats + 1):  # the first of each: warm-up
            dist.barrier()
            begin = time.perf_counter()
            sync.send(version=1)
            sync_ms.append((time.perf_counter() - begin) * 1e3)
            begin = time.perf_counter()
            dst.copy_(src)
            memcpy_ms.append((time.perf_counter() - begin) * 1e3)
    platform.shutdown_distributed()
    if rank != 0:
        return None
    return {
        "tokens": int(tokens),
        "seconds": round(float(seconds), 2),
        "tokens_per_s": round(int(tokens) / float(seconds), 1),
        "weights_mb": weight_bytes and round(weight_bytes / 2**20, 1),
        "peak_rss_gib": round(peak_rss_gib(), 2),
        "sync_ms": sync_ms and round(statistics.median(sync_ms[1:]), 2),
        "memcpy_ms": memcpy_ms and round(statistics.median(memcpy_ms[1:]), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="assets/debug_qwen3_L100")
    parser.add_argument("--expert-parallel", action="store_true", help="MoE experts split too")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8, help="samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--kv-blocks", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5, help="weight syncs timed")
    parser.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--native", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--eager", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:  # one layout's ranks
        from torchtitan_rl import platform

        result = measure(args)
        if result is not None:
            report(result)
        platform.exit_process(0)  # also skips vLLM's slow teardown

    ensure_checkpoint(args.checkpoint)
    me = [__file__, *sys.argv[1:], "--child"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    torchrun += ["--nproc_per_node", "2"]
    layouts = {
        "engine_per_rank": run_child([*torchrun, *me, "--tp", "1"]),
        "engine_per_rank_plain_gemm": run_child([*torchrun, *me, "--tp", "1", "--plain"]),
        "tp2": run_child([*torchrun, *me, "--tp", "2"]),
        "native_tp2": run_child([*torchrun, *me, "--tp", "2", "--native"]),
        "tp2_eager": run_child([*torchrun, *me, "--tp", "2", "--eager"]),
        "native_tp2_eager": run_child([*torchrun, *me, "--tp", "2", "--native", "--eager"]),
    }
    one, plain, tp = (layouts[k] for k in ("engine_per_rank", "engine_per_rank_plain_gemm", "tp2"))
    result = {
        "bench": "generator_tp",
        "checkpoint": args.checkpoint,
        "expert_parallel": args.expert_parallel,
        "workload": {k: getattr(args, k) for k in ("prompts", "samples", "max_tokens")},
        **layouts,
        "tp2_tokens_per_s_vs_engine_per_rank": round(tp["tokens_per_s"] / one["tokens_per_s"], 3),
        "tp2_tokens_per_s_vs_plain_gemm": round(tp["tokens_per_s"] / plain["tokens_per_s"], 3),
        "tp2_weights_vs_engine_per_rank": round(tp["weights_mb"] / plain["weights_mb"], 3),
        "tp2_vs_native_tp2": round(tp["tokens_per_s"] / layouts["native_tp2"]["tokens_per_s"], 3),
        "tp2_vs_native_tp2_eager": round(
            layouts["tp2_eager"]["tokens_per_s"] / layouts["native_tp2_eager"]["tokens_per_s"], 3
        ),
        "tp2_sync_vs_memcpy": round(tp["sync_ms"] / tp["memcpy_ms"], 2),
        "engine_per_rank_sync_vs_memcpy": round(plain["sync_ms"] / plain["memcpy_ms"], 2),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
