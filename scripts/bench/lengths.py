"""Completion lengths of one checkpoint under the two samplers that scripts/bench/e2e.py
compares: our generator (vLLM serving the torchtitan model) and HF `generate` called as TRL's
GRPOTrainer calls it (do_sample, temperature 1, top_p 1, top_k 0, the checkpoint's stop ids).

    .venv/bin/python scripts/make_tiny_checkpoint.py --flavor debugmodel \
        --mean_completion_tokens 100 --out assets/debug_qwen3_L100
    .venv/bin/python scripts/bench/lengths.py --checkpoint assets/debug_qwen3_L100

Both sides sample the same prompt ids (the echo task's prompts of run_configs/debug_cpu.toml,
tokenized by the checkpoint's tokenizer, as TRL tokenizes them), `--n` samples each, up to
`--max_tokens`, with no training: e2e's lengths come from 3 steps of 64 samples whose policy
moves after each step, too few to tell a 10% gap from noise when lengths have a geometric
tail. A length counts the sampled tokens, the stop token included. Prints one JSON line: each
side's samples, mean, standard error of the mean and max; `mean_ratio` = ours / HF and `z`,
the gap between the means in standard errors of the difference.
"""

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

from children import REPO


def summary(lengths: list[int]) -> dict:
    mean = statistics.fmean(lengths)
    sem = statistics.stdev(lengths) / math.sqrt(len(lengths))
    return {
        "samples": len(lengths),
        "mean": round(mean, 2),
        "sem": round(sem, 2),
        "max": max(lengths),
    }


def hf_lengths(args, prompt_ids: list[list[int]], pad_id: int, stop_ids: list[int]) -> list[int]:
    """Lengths of `args.n` samples of each prompt from HF `generate`, as TRL calls it."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32)
    torch.manual_seed(0)
    rows = [p for p in prompt_ids for _ in range(args.n)]
    lengths = []
    for first in range(0, len(rows), args.hf_batch):
        batch = rows[first : first + args.hf_batch]
        width = max(len(r) for r in batch)
        # Left-padded, as TRL pads prompts for generate.
        input_ids = torch.tensor([[pad_id] * (width - len(r)) + r for r in batch])
        pads = torch.tensor([width - len(r) for r in batch])
        attention_mask = (torch.arange(width)[None] >= pads[:, None]).long()
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=args.max_tokens,
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            eos_token_id=stop_ids,
            pad_token_id=pad_id,
        )
        for row in out[:, width:].tolist():
            ends = [i for i, token in enumerate(row) if token in stop_ids]
            lengths.append(ends[0] + 1 if ends else len(row))
        print(f"hf_generate: {len(lengths)}/{len(rows)} samples", file=sys.stderr, flush=True)
    return lengths


def our_lengths(args, prompt_ids: list[list[int]]) -> list[int]:
    """Lengths of `args.n` samples of each prompt from our generator (vLLM), seeded."""
    from torchtitan_rl.config import GeneratorSection, ModelSection, SamplingSection
    from torchtitan_rl.generator.engine import LocalGenerator

    flavor = json.loads((Path(args.checkpoint) / "torchtitan.json").read_text())["flavor"]
    generator = LocalGenerator(
        generator=GeneratorSection(
            max_model_len=max(len(p) for p in prompt_ids) + args.max_tokens + 8,
            sampling=SamplingSection(n=args.n, max_tokens=args.max_tokens, temperature=1.0),
        ),
        model=ModelSection(hf_checkpoint=args.checkpoint, flavor=flavor),
    )
    completions = generator.generate(prompt_ids, seed=0)
    return [s.sampled_tokens for group in completions.samples for s in group]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=str(REPO / "assets" / "debug_qwen3_L100"))
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=16, help="samples per prompt")
    parser.add_argument("--max_tokens", type=int, default=512)
    parser.add_argument("--hf_batch", type=int, default=128, help="rows per HF generate call")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from torchtitan_rl.config import parse_args
    from torchtitan_rl.models import checkpoint_stop_ids
    from torchtitan_rl.tasks import build_task

    config = parse_args(["--job.config_file", str(REPO / "run_configs" / "debug_cpu.toml")])
    task = build_task(config.task, seed=config.job.seed)
    texts = [p.text for step in range(1, 1000) for p in task.prompts(step, 8)][: args.prompts]
    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    prompt_ids = [tokenizer(text)["input_ids"] for text in texts]
    stop_ids = checkpoint_stop_ids(args.checkpoint)

    # HF first: vLLM's CPU worker binds this process's threads when it starts ("CPU backend
    # doesn't allow to use torch.set_num_threads after the thread binding"), and HF's generate
    # would run under that binding.
    start = time.perf_counter()
    hf = hf_lengths(args, prompt_ids, tokenizer.pad_token_id, stop_ids)
    hf_s = time.perf_counter() - start
    start = time.perf_counter()
    ours = our_lengths(args, prompt_ids)
    ours_s = time.perf_counter() - start

    a, b = summary(ours), summary(hf)
    row = {
        "bench": "lengths",
        "checkpoint": args.checkpoint,
        "prompts": args.prompts,
        "n": args.n,
        "max_tokens": args.max_tokens,
        "ours": {**a, "seconds": round(ours_s, 1)},
        "hf_generate": {**b, "seconds": round(hf_s, 1)},
        "mean_ratio": round(a["mean"] / b["mean"], 3),
        "z": round((a["mean"] - b["mean"]) / math.hypot(a["sem"], b["sem"]), 2),
    }
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
    from torchtitan_rl import platform

    platform.exit_process(0)
