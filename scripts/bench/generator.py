"""Benchmark our torchtitan-in-vLLM generator against vLLM's native model, same checkpoint.

    .venv/bin/python scripts/bench/generator.py --checkpoint assets/tiny_qwen3

One run measures both sides, each in a fresh process (one engine per process): the same
prompts, sampling parameters and per-request seeds; one untimed warm-up round, then the median
of the timed rounds. Prints one JSON line: `ours_tokens_per_s`, `native_tokens_per_s` and
`ratio` = ours / native (target >= 0.95). `--checkpoint assets/debug_qwen3` benchmarks the
debugmodel-sized checkpoint, written on first use by scripts/make_tiny_checkpoint.py.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def measure(args: argparse.Namespace) -> dict:
    """Run one side in this process; returns tokens/s of each timed round."""
    import torch

    from torchtitan_rl.config.job_config import GeneratorSection, ModelSection, SamplingSection
    from torchtitan_rl.generator.engine import Generator

    flavor = json.loads((Path(args.checkpoint) / "torchtitan.json").read_text())["flavor"]
    generator = Generator(
        generator=GeneratorSection(
            max_model_len=args.prompt_len + args.max_tokens + 8,
            sampling=SamplingSection(n=args.n, max_tokens=args.max_tokens),
        ),
        model=ModelSection(hf_checkpoint=args.checkpoint, flavor=flavor),
        native=args.side == "native",
    )
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 60, (args.prompts, args.prompt_len), generator=g).tolist()
    rates = []
    for round_ in range(args.rounds + 1):
        start = time.perf_counter()
        completions = generator.generate(prompts, seed=round_ * len(prompts))
        seconds = time.perf_counter() - start
        if round_ > 0:  # round 0 warms up
            rates.append(completions.num_tokens / seconds)
    return {"rates": rates}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=str(REPO / "assets" / "tiny_qwen3"))
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--side", choices=["ours", "native"], help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.side:  # a child process measuring one side
        from torchtitan_rl import platform

        print("RESULT " + json.dumps(measure(args)), flush=True)
        platform.exit_process(0)  # also skips vLLM's slow teardown

    if not (Path(args.checkpoint) / "torchtitan.json").is_file():
        flavor = "debugmodel" if "debug" in Path(args.checkpoint).name else "tiny"
        subprocess.run(
            [
                sys.executable,
                str(REPO / "scripts" / "make_tiny_checkpoint.py"),
                "--out",
                args.checkpoint,
                "--flavor",
                flavor,
            ],
            check=True,
        )
    medians = {}
    for side in ("ours", "native"):
        child = subprocess.run(
            [sys.executable, __file__, *sys.argv[1:], "--side", side],
            capture_output=True,
            text=True,
            env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
        )
        lines = [line for line in child.stdout.splitlines() if line.startswith("RESULT ")]
        if child.returncode != 0 or not lines:
            sys.exit(f"the {side} side failed:\n{child.stderr[-3000:]}")
        medians[side] = statistics.median(json.loads(lines[-1][7:])["rates"])
    print(
        json.dumps(
            {
                "bench": "generator",
                "checkpoint": args.checkpoint,
                "prompts": args.prompts,
                "prompt_len": args.prompt_len,
                "n": args.n,
                "max_tokens": args.max_tokens,
                "ours_tokens_per_s": round(medians["ours"], 1),
                "native_tokens_per_s": round(medians["native"], 1),
                "ratio": round(medians["ours"] / medians["native"], 3),
            }
        )
    )


if __name__ == "__main__":
    main()
