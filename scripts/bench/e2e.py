"""Benchmark whole RL steps: the train entry point's config and flags, one JSON line of figures.

    .venv/bin/python scripts/bench/e2e.py --nproc 2 \
        --job.config_file run_configs/debug_cpu.toml --training.steps 20 [--batch_invariant true]

Runs RLTrainer for `training.steps` steps under `torchrun --nproc_per_node N` and prints the
median over steps 2.. (step 1 warms up) of the step time and its generate / train / weight-sync
split, the generated tokens per second, and the run's shape. With `--batch_invariant true` it
runs the same config with the mode off too and adds `cost_ratio`: step time on / off.
"""

import json
import statistics
import sys

from children import REPO, join_world, report, run_child

from torchtitan_rl import platform
from torchtitan_rl.config import ConfigError, parse_args
from torchtitan_rl.rl_trainer import Hooks, RLTrainer


class Collect(Hooks):
    def __init__(self):
        self.rows: list[dict[str, float]] = []

    def after_step(self, step: int, metrics: dict[str, float]) -> None:
        self.rows.append(metrics)


def measure(flags: list[str]) -> int:
    """The child, one rank of the torchrun world: train, then report the figures (rank 0)."""
    config, rank, world = join_world(flags, prog="scripts/bench/e2e.py")
    collect = Collect()
    if config.generator.placement == "disaggregated":
        from torchtitan_rl import disaggregated

        disaggregated.run(config, hooks=collect)  # rank 0 trains, and collects
    else:
        trainer = RLTrainer(config, hooks=collect)
        for step in range(1, config.training.steps + 1):
            trainer.train_step(step)
    platform.shutdown_distributed()
    if rank == 0:
        timed = collect.rows[1:] or collect.rows

        def median(key: str) -> float:
            return round(statistics.median(r[key] for r in timed), 4)

        report(
            {
                "step_s": median("time/step_s"),
                "generate_s": median("time/generate_s"),
                "train_s": median("time/train_s"),
                "weight_sync_s": median("time/weight_sync_s"),
                "generated_tokens_per_s": median("throughput/generated_tokens_per_s"),
                "final_reward": round(collect.rows[-1]["reward/mean"], 4),
                "logprob_diff_max": max(r["logprob_diff/max"] for r in collect.rows),
                "weight_sync_gb_per_s": median("weight_sync/gb_per_s")
                if "weight_sync/gb_per_s" in timed[0]
                else None,
                "placement": config.generator.placement,
                "max_offpolicy_steps": config.algorithm.max_offpolicy_steps,
                "model_path": config.model.hf_checkpoint,
                "prompts_per_step": config.training.prompts_per_step,
                "group_size": config.generator.sampling.n,
                "max_tokens": config.generator.sampling.max_tokens,
                "nproc": world,
                "steps": config.training.steps,
            }
        )
    return 0


def run(nproc: int, flags: list[str]) -> dict:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    script = str(REPO / "scripts" / "bench" / "e2e.py")
    return run_child([*torchrun, "--nproc_per_node", str(nproc), script, "--child", *flags])


def main() -> int:
    args = sys.argv[1:]
    if args[:1] == ["--child"]:
        return measure(args[1:])
    nproc = 1
    if args[:1] == ["--nproc"]:
        nproc, args = int(args[1]), args[2:]
    try:
        config = parse_args(args, nproc, prog="scripts/bench/e2e.py")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result = {"bench": "e2e", **run(nproc, args)}
    if config.batch_invariant:
        off = run(nproc, [*args, "--batch_invariant", "false"])
        result["batch_invariant"] = True
        result["step_s_mode_off"] = off["step_s"]
        result["logprob_diff_max_mode_off"] = off["logprob_diff_max"]
        result["cost_ratio"] = round(result["step_s"] / off["step_s"], 3)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    platform.exit_process(main())
