"""Benchmark our torchtitan-in-vLLM generator against vLLM's native model, same checkpoint.

    .venv/bin/python scripts/bench/generator.py --checkpoint assets/tiny_qwen3

One run measures both sides, each in fresh processes (one engine per process, the sides
alternating over --trials): the same prompts, sampling parameters and per-request seeds; one
untimed warm-up round per engine, then the median of all timed rounds of a side. Both sides
compiled, as vLLM runs its own models (generator.enforce_eager unset), and, beside them, both
eager. Prints one JSON line: `ours_tokens_per_s`, `native_tokens_per_s` and `ratio` = ours /
native, compiled (target >= 0.95); `eager_ratio` and the eager rates; `tokens_per_round`,
each side's median generated tokens in a round (both sides must process the same work);
`start_s`, each side's median engine start (compilation included: inductor's cache warm
after the first trial).
`--checkpoint assets/smollm2_135m_instruct --compiled_only` benchmarks the real pretrained model
(its shape from config.json; the eager sides skipped).
`--checkpoint assets/debug_qwen3` benchmarks the debugmodel-sized checkpoint, written
on first use by scripts/make_tiny_checkpoint.py (`assets/debug_moe_qwen3`: qwen3's
debugmodel_moe; `assets/debug_gpt_oss`: gpt-oss's debugmodel; `assets/debug_deepseek_v3`:
DeepSeek-V3's, whose 512 + 64 latent vLLM's CPU MLA kernel reads).

Qwen3.5 (`--checkpoint assets/tiny_qwen3_5 --dtype bfloat16`): vLLM's own model runs its Gated
DeltaNet layers with its C++ CPU kernels, which take bf16 only, so both sides run in bf16; its
processes get tests/helpers/stand_ins on their path (vLLM's qwen3_5 module imports
torchvision, which has no CPU wheel for this torch).

Multi-head latent attention (DeepSeek-V3): "native" is vLLM's own model as it runs it, with
its MLA kernel over the latent KV cache (on CPU it then turns prefix caching off);
"native_decompressed" is vLLM's model without MLA (VLLM_MLA_DISABLE=1: keys and values
decompressed per head, as ours). `ratio` is ours / native, `decompressed_ratio` ours /
native_decompressed, and `kv_bytes_per_token` each side's KV cache per token (all layers).
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from children import REPO, ensure_checkpoint, report, run_child

SIDES = ["ours", "native", "ours_eager", "native_eager"]
LATENT_SIDES = [*SIDES, "native_decompressed"]  # multi-head latent attention


def measure(args: argparse.Namespace) -> dict:
    """Run one side in this process; returns tokens/s of each timed round."""
    import torch

    from torchtitan_rl.config import GeneratorSection, ModelSection, SamplingSection
    from torchtitan_rl.generator.engine import LocalGenerator

    start = time.perf_counter()
    generator = LocalGenerator(
        generator=GeneratorSection(
            max_model_len=args.prompt_len + args.max_tokens + 8,
            sampling=SamplingSection(n=args.n, max_tokens=args.max_tokens),
            enforce_eager=True if args.side.endswith("eager") else None,
            dtype=args.dtype,
        ),
        model=ModelSection(**model_of(args.checkpoint), hf_checkpoint=args.checkpoint),
        native=args.side.startswith("native"),  # native_decompressed: VLLM_MLA_DISABLE=1
    )
    start_s = time.perf_counter() - start
    (kv_bytes,) = generator.engine.collective_rpc(_kv_bytes_per_token)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 60, (args.prompts, args.prompt_len), generator=g).tolist()
    rates, tokens = [], []
    for round_ in range(args.rounds + 1):
        start = time.perf_counter()
        completions = generator.generate(prompts, seed=round_ * len(prompts))
        seconds = time.perf_counter() - start
        if round_ > 0:  # round 0 warms up
            rates.append(completions.num_tokens / seconds)
            tokens.append(completions.num_tokens)
    return {"rates": rates, "tokens": tokens, "start_s": [start_s], "kv_bytes_per_token": kv_bytes}


def model_of(checkpoint: str) -> dict[str, str]:
    """The model's name and flavor: those the project's checkpoints record (torchtitan.json),
    else the family of config.json's architecture with the flavor read from it ("auto": a
    pretrained checkpoint, e.g. assets/smollm2_135m_instruct)."""
    from torchtitan_rl.models import FAMILIES

    recipe = Path(checkpoint) / "torchtitan.json"
    if recipe.is_file():
        return {k: v for k, v in json.loads(recipe.read_text()).items() if k in ("name", "flavor")}
    (architecture,) = json.loads((Path(checkpoint) / "config.json").read_text())["architectures"]
    name = next(n for n, f in FAMILIES.items() if architecture in f.hf_architectures)
    return {"name": name, "flavor": "auto"}


def _kv_bytes_per_token(worker) -> int:
    """KV-cache bytes one token takes over all layers: each group's page over its block size,
    times its layers."""
    groups = worker.model_runner.kv_cache_config.kv_cache_groups
    return sum(
        g.kv_cache_spec.page_size_bytes // g.kv_cache_spec.block_size * len(g.layer_names)
        for g in groups
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=str(REPO / "assets" / "tiny_qwen3"))
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=8, help="timed rounds per engine")
    parser.add_argument("--trials", type=int, default=3, help="engines started per side")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument(
        "--compiled_only", action="store_true", help="skip the eager sides (a large model)"
    )
    parser.add_argument("--side", choices=LATENT_SIDES, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.side:  # a child process measuring one side
        from torchtitan_rl import platform

        report(measure(args))
        platform.exit_process(0)  # also skips vLLM's slow teardown

    ensure_checkpoint(args.checkpoint)
    config = json.loads((Path(args.checkpoint) / "config.json").read_text())
    latent = config.get("kv_lora_rank") is not None
    sides = LATENT_SIDES if latent else SIDES
    if args.compiled_only:
        sides = [side for side in sides if not side.endswith("eager")]
    # The sides alternate over trials so that slow phases of a shared machine hit both.
    rates = {side: [] for side in sides}
    tokens = {side: [] for side in sides}
    starts = {side: [] for side in sides}
    kv_bytes = {}
    for _ in range(args.trials):
        for side in sides:
            command = [sys.executable, __file__, *sys.argv[1:], "--side", side]
            env = {"VLLM_MLA_DISABLE": "1"} if side == "native_decompressed" else {}
            if side.startswith("native") and "linear_num_value_heads" in config:  # Qwen3.5
                env["PYTHONPATH"] = str(REPO / "tests" / "helpers" / "stand_ins")
            child = run_child(command, env)
            rates[side] += child["rates"]
            tokens[side] += child["tokens"]
            starts[side] += child["start_s"]
            kv_bytes[side] = child["kv_bytes_per_token"]
    medians = {side: statistics.median(values) for side, values in rates.items()}
    eager_figures = {}
    if "ours_eager" in medians:
        eager_figures = {
            "ours_eager_tokens_per_s": round(medians["ours_eager"], 1),
            "native_eager_tokens_per_s": round(medians["native_eager"], 1),
            "eager_ratio": round(medians["ours_eager"] / medians["native_eager"], 3),
        }
    latent_figures = {}
    if latent:
        latent_figures = {
            "native_decompressed_tokens_per_s": round(medians["native_decompressed"], 1),
            "decompressed_ratio": round(medians["ours"] / medians["native_decompressed"], 3),
        }
    print(
        json.dumps(
            {
                "bench": "generator",
                "checkpoint": args.checkpoint,
                "prompts": args.prompts,
                "prompt_len": args.prompt_len,
                "n": args.n,
                "max_tokens": args.max_tokens,
                "dtype": args.dtype,
                "ours_tokens_per_s": round(medians["ours"], 1),
                "native_tokens_per_s": round(medians["native"], 1),
                "ratio": round(medians["ours"] / medians["native"], 3),
                **eager_figures,
                **latent_figures,
                "kv_bytes_per_token": kv_bytes,
                "tokens_per_round": {side: statistics.median(v) for side, v in tokens.items()},
                "start_s": {side: round(statistics.median(v), 1) for side, v in starts.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
