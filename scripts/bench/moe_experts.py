"""Benchmark the trainer's MoE expert computation on CPU: why `models.moe.Experts` runs
`torch._grouped_mm`, and what its fp32 numerics cost against torchtitan's own module.

    .venv/bin/python scripts/bench/moe_experts.py --flavor debugmodel_moe --tokens 1024

One MoE layer's experts of the flavor (its experts, widths and top-k), a forward and backward
over `--tokens` tokens routed uniformly at random, median of `--steps` after a warm-up, each
variant in turn:
- `grouped`: ours, `torch._grouped_mm` in the model's dtype (what the trainer runs);
- `looped`: one F.linear per expert over its rows (torchtitan's other option);
- `torchtitan_bf16`: torchtitan's `GroupedExperts`, which casts every GEMM to bf16.
Prints one JSON line: milliseconds of each in `--dtype`, and the ratios grouped / looped and
grouped / torchtitan_bf16 (time: below 1 is faster). Also the max |difference| of each from
the fp32 reference, so the bf16 cast's cost in accuracy sits beside its speed.
"""

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torchtitan.models.common.moe import GroupedExperts

from torchtitan_rl.models import model_spec


def looped(x_RD, counts_E, w1_EFD, w2_EDF, w3_EFD):
    # unbind: one backward that stacks the experts' gradients (indexing w[e] per expert
    # would allocate a whole [E, ...] gradient per expert: measured 12x slower here).
    outputs, start = [], 0
    w1s, w2s, w3s = w1_EFD.unbind(0), w2_EDF.unbind(0), w3_EFD.unbind(0)
    for e, count in enumerate(counts_E.tolist()):
        rows_RD = x_RD[start : start + count]
        start += count
        h_RF = F.silu(F.linear(rows_RD, w1s[e])) * F.linear(rows_RD, w3s[e])
        outputs.append(F.linear(h_RF, w2s[e]))
    return torch.cat(outputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="debugmodel_moe")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    torch.manual_seed(0)
    moe = model_spec("qwen3", args.flavor).model.layers[0].moe
    experts = moe.routed_experts.inner_experts.build()  # ours (models.moe.Experts)
    with torch.no_grad():
        for w in (experts.w1_EFD, experts.w2_EDF, experts.w3_EFD):
            w.normal_(std=0.02)
    dtype = getattr(torch, args.dtype)
    experts = experts.to(dtype)
    titan = GroupedExperts(
        GroupedExperts.Config(
            dim=experts.w1_EFD.shape[2],
            hidden_dim=experts.w1_EFD.shape[1],
            num_experts=experts.num_experts,
        )
    )
    titan.load_state_dict(experts.state_dict())
    titan = titan.to(dtype)
    routed = args.tokens * moe.router.top_k
    ids = torch.randint(0, experts.num_experts, (routed,))
    counts_E = torch.bincount(ids, minlength=experts.num_experts)
    x_RD = torch.randn(routed, experts.w1_EFD.shape[2], dtype=dtype)
    weights = (experts.w1_EFD, experts.w2_EDF, experts.w3_EFD)
    variants = {
        "grouped": lambda x: experts(x, counts_E),
        "looped": lambda x: looped(x, counts_E, *weights),
        "torchtitan_bf16": lambda x: titan(x, counts_E),
    }
    reference = looped(x_RD.double(), counts_E, *(w.double() for w in weights))
    ms, error = {}, {}
    for name, fn in variants.items():
        times = []
        for step in range(args.steps + 1):
            x = x_RD.clone().requires_grad_(True)
            start = time.perf_counter()
            y = fn(x)
            y.float().square().sum().backward()
            if step:  # the first warms up
                times.append(time.perf_counter() - start)
        ms[name] = round(statistics.median(times) * 1e3, 2)
        error[name] = float((fn(x_RD).double() - reference).abs().max())
    print(
        json.dumps(
            {
                "bench": "moe_experts",
                "flavor": args.flavor,
                "tokens": args.tokens,
                "dtype": args.dtype,
                "threads": torch.get_num_threads(),
                "ms_forward_backward": ms,
                "grouped_over_looped": round(ms["grouped"] / ms["looped"], 3),
                "grouped_over_torchtitan_bf16": round(ms["grouped"] / ms["torchtitan_bf16"], 3),
                "max_abs_error_vs_fp64": {k: f"{v:.2e}" for k, v in error.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
