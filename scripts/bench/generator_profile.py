"""Where a generator round's CPU goes, ours against vLLM's native model: one JSON line.

    .venv/bin/python scripts/bench/generator_profile.py --checkpoint assets/tiny_moe_qwen3

Each side in a fresh process (scripts/bench/generator.py's workload: 16 prompts x 8 samples x
32 tokens, compiled as vLLM runs it), three untimed rounds, then one round under
torch.profiler: the round's self CPU in ms, the compiled graph's own share (inductor's
kernels, `CompiledFxGraph`), vLLM's custom ops (`_C::`) and the host-side indexing ops
(`aten::slice`, `index`, `nonzero`, `cat`: calls and ms), which tell the model's kernels from
the bookkeeping around them (the routing capture's on an MoE).
"""

import argparse
import json
import sys

from children import REPO, ensure_checkpoint, report, run_child

HOST_OPS = ("aten::slice", "aten::index", "aten::nonzero", "aten::cat")


def measure(args) -> dict:
    import torch

    from torchtitan_rl.config import GeneratorSection, ModelSection, SamplingSection
    from torchtitan_rl.generator.engine import LocalGenerator

    recipe = json.loads((REPO / args.checkpoint / "torchtitan.json").read_text())
    generator = LocalGenerator(
        generator=GeneratorSection(max_model_len=56, sampling=SamplingSection(n=8, max_tokens=32)),
        model=ModelSection(
            name=recipe["name"], flavor=recipe["flavor"], hf_checkpoint=args.checkpoint
        ),
        native=args.side == "native",
    )
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 60, (16, 16), generator=g).tolist()
    for round_ in range(3):
        generator.generate(prompts, seed=round_ * 16)
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities) as profile:
        generator.generate(prompts, seed=100)
    events = profile.key_averages()
    ms = {e.key: e.self_cpu_time_total / 1e3 for e in events}
    calls = {e.key: e.count for e in events}
    return {
        "self_cpu_ms": round(sum(ms.values()), 1),
        "compiled_graph_ms": round(sum(v for k, v in ms.items() if "CompiledFxGraph" in k), 1),
        "vllm_ops_ms": round(sum(v for k, v in ms.items() if k.startswith("_C::")), 1),
        "host_ops": {op: [calls.get(op, 0), round(ms.get(op, 0.0), 1)] for op in HOST_OPS},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", default="assets/tiny_moe_qwen3")
    parser.add_argument("--side", choices=["ours", "native"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        report(measure(args))
        return
    ensure_checkpoint(str(REPO / args.checkpoint))
    me = [sys.executable, __file__, "--checkpoint", args.checkpoint]
    sides = {side: run_child([*me, "--side", side]) for side in ("ours", "native")}
    print(json.dumps({"bench": "generator_profile", "checkpoint": args.checkpoint, **sides}))


if __name__ == "__main__":
    main()
