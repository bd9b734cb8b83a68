"""Benchmark whole RL steps: the train entry point's config and flags, one JSON line of figures.

    .venv/bin/torchrun --standalone --nproc_per_node 2 scripts/bench/e2e.py \
        --job.config_file run_configs/debug_cpu.toml --training.steps 20

Runs RLTrainer for `training.steps` steps and prints (rank 0) the median over steps 2.. (step 1
warms up) of the step time and its generate / train / weight-sync split, the generated tokens
per second, and the run's shape.
"""

import json
import os
import statistics
import sys

from torchtitan_rl import platform
from torchtitan_rl.config import ConfigError, parse_args
from torchtitan_rl.rl_trainer import Hooks, RLTrainer


class Collect(Hooks):
    def __init__(self):
        self.rows: list[dict[str, float]] = []

    def after_step(self, step: int, metrics: dict[str, float]) -> None:
        self.rows.append(metrics)


def main() -> int:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        config = parse_args(sys.argv[1:], world, prog="scripts/bench/e2e.py")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    platform.patch_torchtitan()
    rank, world = platform.init_distributed()
    collect = Collect()
    trainer = RLTrainer(config, hooks=collect)
    for step in range(1, config.training.steps + 1):
        trainer.train_step(step)
    platform.shutdown_distributed()
    if rank == 0:
        timed = collect.rows[1:] or collect.rows

        def median(key: str) -> float:
            return round(statistics.median(r[key] for r in timed), 4)

        print(
            json.dumps(
                {
                    "bench": "e2e",
                    "step_s": median("time/step_s"),
                    "generate_s": median("time/generate_s"),
                    "train_s": median("time/train_s"),
                    "weight_sync_s": median("time/weight_sync_s"),
                    "generated_tokens_per_s": median("throughput/generated_tokens_per_s"),
                    "final_reward": round(collect.rows[-1]["reward/mean"], 4),
                    "model_path": config.model.hf_checkpoint,
                    "prompts_per_step": config.training.prompts_per_step,
                    "group_size": config.generator.sampling.n,
                    "max_tokens": config.generator.sampling.max_tokens,
                    "nproc": world,
                    "steps": config.training.steps,
                }
            ),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    platform.exit_process(main())
