"""Entry point of an RL run: the launcher (torchtitan_rl/launch.py) with the task opened once
and handed to the run's placement (placements/: colocated, disaggregated or continuous).

    torchrun --nproc_per_node 2 -m torchtitan_rl.train --job.config_file run_configs/debug_cpu.toml
    python -m torchtitan_rl.train --job.config_file run_configs/debug_cpu.toml --job.dry_run
"""

from torchtitan_rl import launch, platform
from torchtitan_rl.config import JobConfig
from torchtitan_rl.episodes import OpenTask, open_task


def run(config: JobConfig, task: OpenTask) -> None:
    # Imported in the run: torch.distributed and vLLM chatter starts with them, after the
    # console is routed to run.log.
    from torchtitan_rl import placements
    from torchtitan_rl.loop import load_hooks

    placements.run(config, load_hooks(config), task)


RL = launch.Program(entry="train", open=open_task, run=run)


def main(argv: list[str] | None = None) -> int:
    return launch.main(RL, argv)


if __name__ == "__main__":
    platform.exit_process(main())
