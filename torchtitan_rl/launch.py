"""The launcher of every run, RL (torchtitan_rl.train) or SFT (torchtitan_rl.sft): parse the
config, open the data once, check the dump folder, route the console, join the torchrun world,
run, report a crash, print the summary.

    python -m torchtitan_rl.train --job.config_file run_configs/debug_cpu.toml --job.dry_run
    .venv/bin/python -m pytest tests/unit/test_bad_inputs.py

Config errors exit with code 2 and one line on stderr; a run that stops (`errors.StopRun`)
exits 1 after one line; anything else is a crash, shown with its traceback. A hang exits 124,
a preempted run 75 (torchtitan_rl/watchdog.py). A real run writes
the resolved config to {job.dump_folder}/config.toml; library output goes to
{job.dump_folder}/run.log unless job.verbose (torchtitan_rl/console.py), and rank 0 ends with
a summary of the run.
"""

import os
import shutil
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from torchtitan_rl import console, platform, watchdog
from torchtitan_rl.config import ConfigError, JobConfig, parse_args, to_toml
from torchtitan_rl.config.manager import write_config
from torchtitan_rl.errors import StopRun
from torchtitan_rl.metrics import summary


@dataclass(frozen=True, slots=True)
class Program:
    """What a kind of run adds to the launcher."""

    entry: Literal["train", "sft"]
    """Its module under torchtitan_rl (and the rules `JobConfig.validate` applies)."""
    open: Callable[[JobConfig], Any]
    """Reads and checks the run's data (every row, rendered) before anything is built: a
    dry run checks it too, and the run gets what it returns."""
    run: Callable[[JobConfig, Any], None]
    """Builds and trains, in the torchrun world, with the opened data."""


# Room a run needs besides checkpoints: metrics, TensorBoard, rollouts, an HF export.
MIN_FREE_BYTES = 256 * 2**20


def check_dump_folder(config) -> None:
    """Refuse to start when job.dump_folder cannot be written or lacks the space the run needs
    (checkpoints estimated from the HF checkpoint's size: fp32 weights + two AdamW moments)."""
    folder = Path(config.job.dump_folder)
    probe = folder / f".write_check.{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        raise ConfigError(
            f"job.dump_folder = {str(folder)!r} is not writable ({e.strerror}): "
            "point it at a folder this user can write"
        ) from None
    needed = MIN_FREE_BYTES
    checkpoint = config.checkpoint
    if checkpoint.enable and config.model.hf_checkpoint:
        weights = sum(
            f.stat().st_size for f in Path(config.model.hf_checkpoint).glob("*.safetensors")
        )
        needed += 6 * weights * (checkpoint.keep_latest_k + 1 if checkpoint.keep_latest_k else 2)
    free = shutil.disk_usage(folder).free
    if free < needed:
        raise ConfigError(
            f"job.dump_folder = {str(folder)!r} has {free / 2**20:.0f} MiB free, the run needs "
            f"about {needed / 2**20:.0f} MiB (metrics and checkpoints): free space, move "
            "job.dump_folder, or lower checkpoint.keep_latest_k"
        )


def derived_shape(model) -> str:
    """A TOML comment with the shape of a flavor read from the checkpoint (model.flavor =
    "auto"), '' for a named flavor."""
    from torchtitan_rl.models import describe, from_hf, model_spec

    if from_hf.checkpoint_of(model.flavor) is None:
        return ""
    shape = describe(model.name, model_spec(model.name, model.flavor).model)
    return f"# model.flavor = 'auto': {shape}\n"


def main(program: Program, argv: list[str] | None = None) -> int:
    """Run `program` with the command line `argv` (sys.argv[1:] when None); the exit code."""
    start = time.monotonic()
    argv = sys.argv[1:] if argv is None else argv
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    try:
        entry = program.entry
        config = parse_args(argv, world_size, prog=f"torchtitan_rl.{entry}", entry=entry)
        # Every dataset row, rendered prompt and the reward function, before anything is
        # built (a dry run checks them too).
        opened = program.open(config)
    except ConfigError as e:
        console.error(f"error: {e}")
        return 2
    if config.job.dry_run:
        if rank == 0:
            print(derived_shape(config.model) + to_toml(config), end="")
        return 0

    try:
        check_dump_folder(config)
    except ConfigError as e:
        console.error(f"error: {e}")
        return 2
    # Before torch.distributed and vLLM are imported: most of their chatter starts there.
    if not config.job.verbose:
        log = console.redirect(config.job.dump_folder, rank)
        if rank == 0:
            # The engine takes a while to start; say where its output goes meanwhile.
            console.say(f"starting: library output goes to {log} (--job.verbose shows it here)")
    try:
        code = run(config, program, opened)
    except Exception:
        if (earlier := watchdog.fail()) is not None:
            return follows(earlier, traceback.format_exc())
        report_crash()
        return 1
    if code == 0 and rank == 0:
        say_summary(config, time.monotonic() - start)
    return code


def report_crash() -> None:
    """An exception that is not one of ours: its whole traceback on the console and in the
    log, then where the library output around it is."""
    console.error(traceback.format_exc().rstrip())
    if console.log_path() is not None:
        console.error(f"see {console.log_path()} for library output")


def follows(alarm: str, error: str) -> int:
    """This rank's error after another rank stopped the run (`alarm`: "failed R" or "hang"):
    that rank's line is on the console, this one goes to the log. Exit code 1, or 124 after a
    hang: a rank whose collective broke as a hung peer exited exits as that peer did (its guard
    had written its stacks before any rank could exit)."""
    first = watchdog.what_happened(alarm)
    print(f"watchdog: {first}; then this rank got:\n{error}", file=sys.stderr)
    return watchdog.EXIT_HANG if alarm == "hang" else 1


def say_summary(config, wall_s: float) -> None:
    """The closing lines of a finished run (rank 0, which writes the metrics)."""
    dump = Path(config.job.dump_folder)
    lines = summary(
        dump, wall_s=wall_s, log=console.log_path(), checkpoints=dump / config.checkpoint.folder
    )
    for line in lines:
        console.say(line)


def run(config: JobConfig, program: Program, opened) -> int:
    """Join the torchrun world and run `program`; returns the exit code (2: a config error, 1:
    the run stopped, each after one line on stderr)."""
    platform.patch_torchtitan()
    rank, _ = platform.init_distributed(config.job.collective_timeout_s)
    logs = Path(config.job.dump_folder) / "run*.log"
    watchdog.start(
        config.job.phase_timeout_s,
        checkpointing=config.checkpoint.enable,
        log_hint="stderr" if config.job.verbose else str(logs),
    )
    try:
        if rank == 0:
            write_config(config, Path(config.job.dump_folder) / "config.toml")
        program.run(config, opened)
    except watchdog.Preempted as e:
        # Every rank stops after the same step; one line says where to resume from.
        if rank == 0:
            console.say(str(e))
        return watchdog.EXIT_PREEMPTED
    except ConfigError as e:
        # Every rank meets the same config error; torchrun collects the exit codes.
        if (earlier := watchdog.fail()) is not None:
            return follows(earlier, f"error: {e}")
        console.error(f"error: {e}")
        return 2
    except StopRun as e:
        # A non-finite value, a failing reward function, a bad weight copy, a failed engine:
        # stop, say why; the other ranks exit at once (watchdog.fail).
        if (earlier := watchdog.fail()) is not None:
            return follows(earlier, f"error: {e}")
        if e.__cause__ is not None:  # the library's own traceback, for the log
            traceback.print_exception(e.__cause__, file=sys.stderr)
        console.error(f"error: {e}")
        return 1
    watchdog.stop()
    platform.shutdown_distributed()
    return 0
