"""What DTensor's eager dispatch costs a tensor-parallel decoder layer per forward, on this
machine's device: one JSON line. Pure torch (runs where torchtitan and vLLM are not installed).

    .venv/bin/python scripts/bench/dtensor_dispatch.py
    python3 scripts/bench/dtensor_dispatch.py --device cuda   (a GPU machine)

A decoder-shaped layer (norm, q/k/v/o projections, SDPA, norm, SwiGLU MLP) runs on a decode-sized
batch twice: with plain tensors, and with the sharding a TP plan gives it (column- then
row-parallel linears, sequence parallel norms: torch's `parallelize_module`) on a mesh of one
rank, where every collective is a no-op. The difference is the per-layer price of dispatching
through DTensor, which a TP generator pays per layer and per decode step whatever the device.

`--compile` also times the sharded layer under `torch.compile` (default mode), and on CUDA
under `mode="reduce-overhead"` (CUDA graphs): whether compiling the TP wrapper would take the
dispatch away, which the generator does not do yet (docs/limitations.md).
"""

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class Layer(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        self.heads = heads
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.wq, self.wk, self.wv = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.wo = nn.Linear(dim, dim, bias=False)
        self.w1, self.w3 = (nn.Linear(dim, hidden, bias=False) for _ in range(2))
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        h = self.attention_norm(x_BTD)
        q, k, v = (
            w(h).unflatten(-1, (-1, 64)).transpose(1, 2) for w in (self.wq, self.wk, self.wv)
        )
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x_BTD = x_BTD + self.wo(a.transpose(1, 2).flatten(2))
        h = self.ffn_norm(x_BTD)
        return x_BTD + self.w2(F.silu(self.w1(h)) * self.w3(h))


def tensor_parallel(layer: Layer, mesh) -> Layer:
    """The layer as torchtitan's TP plan shards a decoder layer: sequence-parallel norms,
    column-parallel q/k/v and w1/w3 (gathering the tokens), row-parallel wo and w2 (scattering
    them back)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    gather = {"input_layouts": Shard(1), "use_local_output": True}
    plan = {
        "attention_norm": SequenceParallel(),
        "ffn_norm": SequenceParallel(),
        **{name: ColwiseParallel(**gather) for name in ("wq", "wk", "wv", "w1", "w3")},
        "wo": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "w2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }
    return parallelize_module(layer, mesh, plan)


def time_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, default=64, help="a decode step's batch")
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--compile", action="store_true", help="also time it compiled")
    args = parser.parse_args()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend, rank=0, world_size=1)
    device = torch.device(args.device)
    mesh = init_device_mesh(args.device, (1,))
    torch.manual_seed(0)
    plain = Layer(args.dim, args.dim // 64, 3 * args.dim).to(device)
    sharded = tensor_parallel(Layer(args.dim, args.dim // 64, 3 * args.dim).to(device), mesh)
    x = torch.randn(1, args.tokens, args.dim, device=device)
    x_sharded = DTensor.from_local(x, mesh, [Shard(1)])
    compiled = {}
    with torch.no_grad():
        plain_ms = time_ms(lambda: plain(x), args.repeats)
        dtensor_ms = time_ms(lambda: sharded(x_sharded), args.repeats)
        modes = ["default", "reduce-overhead"] if args.device == "cuda" else ["default"]
        for mode in modes if args.compile else []:
            torch._dynamo.reset()
            layer = torch.compile(sharded, mode=mode)
            start = time.perf_counter()
            layer(x_sharded)  # compiles
            compile_s = time.perf_counter() - start
            compiled[f"compiled_{mode}_ms_per_layer"] = round(
                time_ms(lambda layer=layer: layer(x_sharded), args.repeats), 3
            )
            compiled[f"compiled_{mode}_ratio"] = round(
                compiled[f"compiled_{mode}_ms_per_layer"] / plain_ms, 2
            )
            compiled[f"compiled_{mode}_compile_s"] = round(compile_s, 1)
    print(
        json.dumps(
            {
                "bench": "dtensor_dispatch",
                "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                "torch": torch.__version__,
                "tokens": args.tokens,
                "dim": args.dim,
                "plain_ms_per_layer": round(plain_ms, 3),
                "dtensor_ms_per_layer": round(dtensor_ms, 3),
                "overhead_ms_per_layer": round(dtensor_ms - plain_ms, 3),
                "ratio": round(dtensor_ms / plain_ms, 2),
                **compiled,
            }
        )
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
