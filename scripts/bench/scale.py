"""Benchmark how the colocated loop scales with model size: one JSON line per size.

    .venv/bin/python scripts/bench/scale.py --sizes tiny,debugmodel,0.6B [--steps 3] [flags]

For each Qwen3 flavor in `--sizes` (`tiny`, `debugmodel`, `0.6B`: real shapes, the real
151,936-token vocabulary) it runs RLTrainer on 2 ranks under `torchrun` (colocated, FSDP over
both) with prompts of 256 tokens and completions of up to 128, 2 prompts x 2 samples per step,
in 2 micro-batches with full activation checkpointing and the generator's weights freed during
training (`generator.enable_sleep_mode`), and prints: the parameter count; the peak RSS of each
rank (ru_maxrss) and the peak total RSS of the whole process tree (torchrun, ranks and anything
they spawn), sampled here every 0.2 s; the median over steps 2.. (step 1 warms up) of the step
time and its split (generate / train / sync / other, other = the step's wall time less the
three); tokens per second (prompt + generated tokens of every sequence per second of step time,
and generated tokens per second of generate time); the weight sync's GB/s and `sync_vs_memcpy`,
the sync time over one plain `copy_` of the same bytes (the generator's weights) timed on every
rank at once in the same run. A last line compares sizes: `growth` is the step-time ratio over
the parameter ratio (0.6B / debugmodel; <= 1: step time grows no faster than linearly in
parameters).

The weights are torchtitan's random init of each flavor (seed 0), written once as an HF
checkpoint under assets/ (the generator starts from one); the tokenizer is the 68-token
character tokenizer of assets/tiny_qwen3. Extra flags are the train entry point's and override
the defaults below, for every size (e.g. `--generator.cpu_packed_gemm false`). The run stops
itself, and says so, if the machine's available memory falls under `--min_free_gib`.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from children import (
    REPO,
    MemoryWatch,
    ensure_checkpoint,
    join_world,
    peak_rss_gib,
    report,
    run_child,
)

from torchtitan_rl import platform
from torchtitan_rl.config import ConfigError, parse_args
from torchtitan_rl.loop import Hooks
from torchtitan_rl.placements.colocated import RLTrainer
from torchtitan_rl.weight_sync import SyncStats

NPROC = 2
PROMPT_TOKENS, COMPLETION_TOKENS = 256, 128
TOKENIZER = "assets/tiny_qwen3"
# Each size's random-init checkpoint (children.ensure_checkpoint writes the first two).
CHECKPOINTS = {
    "tiny": "assets/tiny_qwen3",
    "debugmodel": "assets/debug_qwen3",
    "0.6B": "assets/random_qwen3_0.6B",
}

# The packed GEMM copies hold a second fp32 copy of the generator's weights: 2.4 GB per rank at
# 0.6B, where an unpacked rank already passed 9.3 GiB in its first step (next to the trainer's
# 4.8 GB of sharded weights, gradients and AdamW state).
SIZE_FLAGS = {"0.6B": ["--generator.cpu_packed_gemm", "false"]}


def defaults(size: str, steps: int, dump_folder: str) -> list[str]:
    """The run's flags for one size; the user's flags come after them and win."""
    return [
        *("--model.name", "qwen3", "--model.flavor", size),
        *("--model.hf_checkpoint", CHECKPOINTS[size], "--model.tokenizer_path", TOKENIZER),
        *("--training.steps", str(steps), "--training.prompts_per_step", str(NPROC)),
        *("--training.max_prompt_len", str(PROMPT_TOKENS), "--training.micro_batches", "2"),
        # Split by row count: packing (micro_batch_tokens > 0) would decide the micro-batches.
        *("--training.micro_batch_tokens", "0"),
        # Recompute each block in backward: the memory a real-size run needs, at every size.
        *("--training.activation_checkpoint", "full"),
        # The generator's weights are freed while the trainer trains (refilled by the sync).
        *("--generator.enable_sleep_mode", "true"),
        *("--generator.sampling.n", "2", "--generator.sampling.max_tokens", str(COMPLETION_TOKENS)),
        *("--generator.max_model_len", str(PROMPT_TOKENS + COMPLETION_TOKENS)),
        # 'echo <digits>:' is len(digits) + 6 characters, one token each.
        *("--task.name", "echo_digits", "--task.num_digits", str(PROMPT_TOKENS - 6)),
        # A CPU block holds 128 tokens: 2 samples x 3 blocks, plus room; keeps the 0.6B KV small.
        *("--generator.num_kv_blocks", "8"),
        *("--metrics.rollout_log_interval", "0", "--job.dump_folder", dump_folder),
        *SIZE_FLAGS.get(size, []),
    ]


class StepTimer(Hooks):
    """Each step's wall time (before_step to after_step), metrics and weight-sync stats."""

    def __init__(self):
        self.rows: list[dict[str, float]] = []
        self.syncs: list[SyncStats] = []
        self.start = 0.0

    def before_step(self, step: int) -> None:
        self.start = time.perf_counter()

    def after_sync(self, step: int, stats: SyncStats) -> None:
        self.syncs.append(stats)

    def after_step(self, step: int, metrics: dict[str, float]) -> None:
        self.rows.append({**metrics, "wall_s": time.perf_counter() - self.start})


def memcpy_seconds(params: list[torch.Tensor], repeats: int = 3) -> float:
    """Best time to `copy_` every tensor once (the same bytes a sync writes), on every rank at
    once as the sync runs; the destination is one reused buffer of the largest tensor."""
    scratch = torch.empty(max(p.numel() for p in params), dtype=params[0].dtype)
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        for p in params:
            scratch[: p.numel()].view_as(p).copy_(p.detach())
        times.append(time.perf_counter() - start)
    return min(times)


def measure(flags: list[str]) -> int:
    """The child, one rank of the torchrun world: train, then report the figures (rank 0)."""
    config, rank, world = join_world(flags, prog="scripts/bench/scale.py")
    timer = StepTimer()
    trainer = RLTrainer(config, hooks=timer)
    for step in range(1, config.training.steps + 1):
        trainer.train_step(step)
    rss = platform.all_gather_objects(peak_rss_gib())  # before the memcpy's scratch buffer
    generator_params = list(trainer.generator.weights().values())
    copy_s = max(platform.all_gather_objects(memcpy_seconds(generator_params)))
    params = sum(p.numel() for p in trainer.learner.trainer.named_parameters().values())
    prompt_tokens = len(trainer.producer.renderer.encode(trainer.producer.prompts(1))[0])
    platform.shutdown_distributed()
    if rank != 0:
        return 0
    timed = list(range(1, len(timer.rows))) or [0]

    def median(values) -> float:
        return statistics.median(values[i] for i in timed)

    rows = timer.rows
    step_s = median([r["wall_s"] for r in rows])
    generate_s = median([r["time/generate_s"] for r in rows])
    train_s = median([r["time/train_s"] for r in rows])
    sync_s = median([s.seconds for s in timer.syncs])
    sync_bytes = timer.syncs[-1].bytes
    sampling = config.generator.sampling
    sequences = config.training.prompts_per_step * sampling.n
    tokens = median([sequences * prompt_tokens + r["generated_tokens"] for r in rows])
    report(
        {
            "params": params,
            "model_dtype": config.model.dtype,
            "generator_dtype": config.generator.dtype,
            "cpu_packed_gemm": config.generator.cpu_packed_gemm,
            "peak_rss_gib_per_rank": [round(gib, 3) for gib in rss],
            "step_s": round(step_s, 4),
            "generate_s": round(generate_s, 4),
            "train_s": round(train_s, 4),
            "sync_s": round(sync_s, 4),
            "other_s": round(step_s - generate_s - train_s - sync_s, 4),
            "tokens_per_s": round(tokens / step_s, 2),
            "generated_tokens_per_s": round(
                median([r["generated_tokens"] / r["time/generate_s"] for r in rows]), 2
            ),
            "sync_bytes": sync_bytes,
            "sync_gb_per_s": round(sync_bytes / sync_s / 1e9, 3),
            "memcpy_s": round(copy_s, 4),
            "memcpy_gb_per_s": round(sync_bytes / copy_s / 1e9, 3),
            "sync_vs_memcpy": round(sync_s / copy_s, 3),
            "sync_peak_extra_gib": round(timer.syncs[-1].peak_extra_bytes / 2**30, 3),
            "prompt_tokens": prompt_tokens,
            "response_length_mean": round(
                statistics.mean(r["response_length/mean"] for r in rows), 2
            ),
            "max_tokens": sampling.max_tokens,
            "sequences_per_step": sequences,
            "nproc": world,
            "steps": config.training.steps,
        }
    )
    return 0


def ensure_random_checkpoint(size: str) -> None:
    path = REPO / CHECKPOINTS[size]
    if size != "0.6B":
        ensure_checkpoint(str(path))
    elif not (path / "torchtitan.json").is_file():
        script = str(REPO / "scripts" / "make_tiny_checkpoint.py")
        command = [sys.executable, script, "--out", str(path), "--flavor", size]
        subprocess.run(command, check=True)


def run(size: str, steps: int, flags: list[str], min_free_gib: float) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"scale_{size}_") as dump:
        flags = [*defaults(size, steps, dump), *flags]
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        script = str(REPO / "scripts" / "bench" / "scale.py")
        command = [*torchrun, "--nproc_per_node", str(NPROC), script, "--child", *flags]
        with MemoryWatch(min_free_gib) as watch:
            try:
                result = run_child(command)
            except SystemExit:
                if not watch.fired:
                    raise
                # What it reached before the machine ran out: the row says it did not finish.
                result = {"completed": False, "stopped": f"available memory < {min_free_gib} GiB"}
    return {
        "bench": "scale",
        "size": size,
        "completed": True,
        **result,
        "tree_peak_rss_gib": round(watch.peak / 2**30, 3),
        "min_available_gib": round(watch.min_available, 3),
        # Other work on the machine slows every figure above: its load average, for the record.
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }


def main() -> int:
    args = sys.argv[1:]
    if args[:1] == ["--child"]:
        return measure(args[1:])
    sizes, steps, min_free_gib = list(CHECKPOINTS), 3, 2.0
    while args[:1] in (["--sizes"], ["--steps"], ["--min_free_gib"]):
        name, value, args = args[0], args[1], args[2:]
        if name == "--sizes":
            sizes = value.split(",")
        elif name == "--steps":
            steps = int(value)
        else:
            min_free_gib = float(value)
    unknown = [s for s in sizes if s not in CHECKPOINTS]
    if unknown:
        print(f"error: --sizes {unknown[0]!r}: use some of {', '.join(CHECKPOINTS)}")
        return 2
    for size in sizes:
        ensure_random_checkpoint(size)
    try:
        for size in sizes:  # fail on a bad flag before anything runs
            parse_args([*defaults(size, steps, "outputs/scale"), *args], NPROC)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    results = {}
    for size in sizes:
        result = run(size, steps, args, min_free_gib)
        results[size] = result
        print(json.dumps(result), flush=True)
    if "step_s" in results.get("debugmodel", {}) and "step_s" in results.get("0.6B", {}):
        small, large = results["debugmodel"], results["0.6B"]
        step_ratio = large["step_s"] / small["step_s"]
        params_ratio = large["params"] / small["params"]
        summary = {
            "bench": "scale_summary",
            "step_ratio": round(step_ratio, 3),
            "params_ratio": round(params_ratio, 3),
            "growth": round(step_ratio / params_ratio, 3),
            "fits_24_gib": large["tree_peak_rss_gib"] <= 24,
            "sync_vs_memcpy": large["sync_vs_memcpy"],
        }
        print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    platform.exit_process(main())
