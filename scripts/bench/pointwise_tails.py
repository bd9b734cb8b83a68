"""How often ATen's elementwise ops give a value one bit apart when it is computed alone rather
than in a vector: one JSON line. Why batch-invariant mode runs gates through `ops.pointwise`
(torchtitan_rl/batch_invariant/ops.py, docs/batch_invariant.md).

    .venv/bin/python scripts/bench/pointwise_tails.py

ATen's CPU loop computes a tensor's elements in vector registers and the last few (the
remainder past a multiple of the vector width) with scalar code, which rounds differently for
transcendental ops. A value's bits then depend on where it falls in the tensor, so a gate
computed over a batch of one token differs from the same token's gate among many. For each op,
`--values` standard-normal floats are computed as one tensor and each alone (a one-element
tensor: all scalar code), and the fraction that differ is printed. Depends on the CPU's vector
unit (AVX2 or AVX-512), so compare only within one machine.
"""

import argparse
import json

import torch
import torch.nn.functional as F

OPS = {"sigmoid": torch.sigmoid, "softplus": F.softplus, "silu": F.silu, "exp": torch.exp}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--values", type=int, default=100_000)
    args = parser.parse_args()
    torch.manual_seed(0)
    x = torch.randn(args.values)
    figures = {}
    for name, op in OPS.items():
        together = op(x)
        alone = torch.cat([op(value) for value in x.split(1)])
        figures[f"{name}_differ"] = round(float((together != alone).float().mean()), 4)
    capability = torch.backends.cpu.get_cpu_capability()
    print(
        json.dumps(
            {"bench": "pointwise_tails", "values": args.values, "cpu": capability, **figures}
        )
    )


if __name__ == "__main__":
    main()
