"""Placements: where a run's producer, learner and weight transport run, each on the one loop
(`loop.train`). colocated.py: every rank generates, then trains. disaggregated.py: generator
ranks apart, whole steps, bounded staleness. continuous.py: generator ranks that keep their
engines full and take weights between engine steps.

    torchrun --nproc_per_node 2 -m torchtitan_rl.train \
        --job.config_file run_configs/debug_cpu.toml \
        --generator.placement continuous --algorithm.max_offpolicy_steps 1
"""

import importlib

from torchtitan_rl.config import JobConfig
from torchtitan_rl.episodes import OpenTask


def run(config: JobConfig, hooks=None, task: OpenTask | None = None) -> None:
    """Run the placement that generator.placement names, on every rank (`hooks`: the loop's,
    `loop.load_hooks`; `task` opened, or opened by the placement when None)."""
    placement = importlib.import_module(f"torchtitan_rl.placements.{config.generator.placement}")
    placement.run(config, hooks, task)
