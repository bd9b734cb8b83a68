"""A decode step's Gated DeltaNet convolution for a batch of requests, on vLLM's CPU kernel
(what the generator runs, generator/hybrid.py `_vllm_conv`) against this project's torch
routine on the gathered states (`models/gated_delta.causal_conv`): one JSON line of medians.

    .venv/bin/python scripts/bench/gated_delta_conv.py

bf16 (the kernel's only dtype), Qwen3.5's convolution width 4 over `--channels` channels
(key, key and value heads: 8192 at the 35B-A3B shape), one token per request, each request's
state in its own slot of a pool of slots. The kernel updates the slots in place; the routine
gathers the requests' states, convolves, and scatters the new ones back, as it would have to.
"""

import argparse
import json

import torch
from children import median_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--channels", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()

    from vllm import _custom_ops as ops

    from torchtitan_rl.models import gated_delta

    torch.manual_seed(0)
    R, C, W = args.requests, args.channels, 4
    dtype = torch.bfloat16
    x_RC = torch.randn(R, C, dtype=dtype)
    weight_C1W = torch.randn(C, 1, W, dtype=dtype)
    weight_CW = weight_C1W[:, 0].contiguous()
    pool_SCW = torch.randn(2 * R, C, W - 1, dtype=dtype)  # vLLM's slots: (C, W - 1) each
    slots_R = torch.randperm(2 * R)[:R].to(torch.int32)

    def kernel():
        ops.causal_conv1d_update_cpu(
            x_RC, pool_SCW, weight_CW, None, True, slots_R, is_weight_packed=False
        )

    def routine():
        states_RCW = pool_SCW[slots_R.long()]
        _, new_RCW = gated_delta.causal_conv(x_RC[:, None], weight_C1W, states_RCW)
        pool_SCW[slots_R.long()] = new_RCW

    figures = {
        "vllm_kernel_ms": round(median_ms(kernel, args.repeats, warmup=3), 3),
        "torch_routine_ms": round(median_ms(routine, args.repeats, warmup=3), 3),
    }
    figures["routine_vs_kernel"] = round(figures["torch_routine_ms"] / figures["vllm_kernel_ms"], 2)
    print(
        json.dumps(
            {
                "bench": "gated_delta_conv",
                "requests": R,
                "channels": C,
                "cpu": torch.backends.cpu.get_cpu_capability(),
                **figures,
            }
        )
    )


if __name__ == "__main__":
    main()
