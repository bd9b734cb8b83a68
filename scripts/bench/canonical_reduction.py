"""Benchmark the canonical reduction of a row-parallel layer against the plain one.

    .venv/bin/python scripts/bench/canonical_reduction.py [--threads 2] [--dtype bfloat16]

Under batch-invariant mode with a tensor-parallel side, every row-parallel linear (attention
output, MLP down projection) runs `ops.partial_products` over `--slices` slices of its input
dimension and sums them as a tree (batch_invariant/ops.py); without a TP side it runs
`ops.linear`, one row-padded GEMM. For the down projections of real shapes (SmolLM2-135M,
Qwen3-0.6B, Qwen3-8B) and row counts of a decode batch, a prefill and a training micro-batch,
prints one JSON line: the median time of each, `ratio` = canonical / plain on one device
(the trainer's side), and `rank_ratio` = a TP rank's canonical half (its block of slices,
in fp32 for the cross-rank sum) / its plain half (`ops.linear` on the same columns), the
generator rank's side before the all-reduce.
"""

import argparse
import json
import statistics
import time

import torch

from torchtitan_rl.batch_invariant import ops

# (model, input features, output features) of each model's MLP down projection.
SHAPES = [("smollm2_135m", 1536, 576), ("qwen3_0.6b", 3072, 1024), ("qwen3_8b", 12288, 4096)]
ROWS = {"decode": 16, "prefill": 512, "train": 2048}


def median_s(fn, repeats: int) -> float:
    fn()  # warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.no_grad()
def layer(x: torch.Tensor, weight: torch.Tensor, width: int, repeats: int) -> dict:
    """One layer's figures at x's rows: plain and canonical, on one device and on a TP rank's
    half of the columns."""
    half = slice(0, x.shape[-1] // 2)
    plain = median_s(lambda: ops.linear(x, weight), repeats)
    canonical = median_s(lambda: ops.partial_products(x, weight, width).to(x.dtype), repeats)
    rank_plain = median_s(lambda: ops.linear(x[:, half], weight[:, half]), repeats)
    rank_canonical = median_s(
        lambda: ops.partial_products(x[:, half], weight[:, half], width), repeats
    )
    return {
        "rows": x.shape[0],
        "plain_ms": round(plain * 1e3, 3),
        "canonical_ms": round(canonical * 1e3, 3),
        "ratio": round(canonical / plain, 3),
        "rank_ratio": round(rank_canonical / rank_plain, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--slices", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    figures = {}
    for model, width_in, width_out in SHAPES:
        weight = torch.randn(width_out, width_in, generator=g).to(dtype)
        width = width_in // args.slices
        for phase, rows in ROWS.items():
            if width_in * rows > 12288 * 512:  # the 8B's training rows: minutes on 2 cores
                continue
            x = torch.randn(rows, width_in, generator=g).to(dtype)
            figures[f"{model}/{phase}"] = layer(x, weight, width, args.repeats)
    print(
        json.dumps(
            {
                "bench": "canonical_reduction",
                "dtype": args.dtype,
                "threads": args.threads,
                "slices": args.slices,
                "cpu": torch.backends.cpu.get_cpu_capability(),
                "layers": figures,
                "ratio_max": max(f["ratio"] for f in figures.values()),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
