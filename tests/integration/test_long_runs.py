"""Long runs on shared clusters: a rank that hangs, a scheduler's SIGTERM, an engine that
fails. Each fault is injected into a real run: torchrun with 2 ranks, the real vLLM engine.

    .venv/bin/python -m pytest tests/integration/test_long_runs.py

The watchdog itself, in one process: tests/unit/test_watchdog.py. A checkpoint that cannot
fit: tests/unit/test_checkpoint.py; a failing checkpoint write: test_faults.py.
"""

import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
from helpers import runs
from helpers.launch import (
    DEBUG_TOML,
    HELPERS,
    assert_resumed_as,
    kill_tree,
    launcher,
    metric_rows,
    preempt,
    run_train,
    start_piped,
    wait_for_step,
)

from torchtitan_rl.checkpoint import invalid_reason
from torchtitan_rl.watchdog import EXIT_HANG

HOOKS_ENV = {"PYTHONPATH": HELPERS}


def start(*flags: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """torchrun with 2 ranks of torchtitan_rl.train, its console piped; the ranks are started
    by torchrun itself, not forked: the tests look at their processes."""
    return start_piped([*launcher(2, forked=False), "-m", "torchtitan_rl.train", *flags], env)


@dataclass
class Ended:
    """How a run with a fault ended: its exit code and stderr, the seconds from the fault's
    step to its end, and the processes it had then."""

    returncode: int
    stderr: str
    seconds: float
    processes: list[psutil.Process]


def run_into(flags: tuple[str, ...], out: Path, step: int, env=None, fault=None) -> Ended:
    """Launch; once `step` is logged call `fault(processes)` (if any) and wait for the end."""
    process = start(*flags, "--job.dump_folder", str(out), env=env)
    try:
        wait_for_step(process, out, step)
        processes = processes_under(process)
        if fault is not None:
            fault(processes)
        began = time.monotonic()
        _, stderr = process.communicate(timeout=120)
        seconds = time.monotonic() - began
    finally:
        kill_tree(process)
    return Ended(process.returncode, stderr, seconds, processes)


def processes_under(process: subprocess.Popen) -> list[psutil.Process]:
    return psutil.Process(process.pid).children(recursive=True)


def assert_all_gone(processes: list[psutil.Process]) -> None:
    alive = [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, alive


def errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


def test_a_rank_stuck_in_a_phase_is_named_its_stacks_logged_and_every_rank_exits(tmp_path):
    """Rank 1 sleeps at the end of step 2's train phase; rank 0 waits for it in its weight
    sync. With job.phase_timeout_s = 10: one line names the step, the phase and rank 1, every
    rank's stacks are in its log, the ranks exit 124, torchrun ends, no process is left."""
    flags = (
        *("--job.config_file", DEBUG_TOML, "--training.steps", "4"),
        *("--job.hooks", "user_hooks:HangsInTrainOnRank1", "--job.phase_timeout_s", "10"),
        *("--job.collective_timeout_s", "70"),
    )
    ended = run_into(flags, tmp_path, 1, env=HOOKS_ENV)  # step 2 starts as step 1 is logged
    assert ended.returncode != 0
    assert errors(ended.stderr) == [
        "error: step 2: rank 1 did not finish phase 'train' within job.phase_timeout_s = 10 s "
        "(rank 0 in 'weight_sync' of step 2); the Python stacks of every rank are in "
        f"{tmp_path}/run*.log: raise job.phase_timeout_s if the phase is slow, not stuck"
    ]
    # Both ranks' exit codes, in torchrun's report of the failed ranks.
    assert ended.stderr.count(f"exitcode  : {EXIT_HANG} ") == 2, ended.stderr[-3000:]
    # 10 s of phase, <= 1 s to notice, the stacks: far from the 70 s a collective would take.
    assert ended.seconds < 40, ended.seconds
    stuck = (tmp_path / "run.rank1.log").read_text()
    assert "watchdog: rank 1: a phase ran past job.phase_timeout_s; stacks:" in stuck
    assert re.search(r'File ".*user_hooks\.py", line \d+ in after_train', stuck)
    waiting = (tmp_path / "run.log").read_text()
    assert "watchdog: rank 0: a phase ran past job.phase_timeout_s; stacks:" in waiting
    assert re.search(r'File ".*weight_sync/local\.py", line \d+ in send', waiting)
    assert_all_gone(ended.processes)


def test_sigterm_colocated_finishes_the_step_checkpoints_and_resumes_as_uninterrupted(
    reference_run, tmp_path
):
    """The reference run's flags (checkpoints every 3 steps), SIGTERM after step 4: the run
    saves the step it is in although no checkpoint is due, and the relaunch ends as the
    uninterrupted reference did."""
    out = tmp_path / "preempted"
    step = preempt(runs.REFERENCE, out, after_step=4, sig=signal.SIGTERM, rank=None)
    assert step % 3 and step < 6, step  # not a due checkpoint, and not the last step
    resumed = run_train(*runs.REFERENCE, "--job.dump_folder", str(out), nproc=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {out / 'checkpoints' / f'step-{step}'}" in resumed.stdout
    assert_resumed_as(reference_run.folder, out, step, exact=False)


def test_a_disaggregated_run_preempted_twice_ends_as_the_uninterrupted_run(tmp_path):
    """k = 0 disaggregated with DAPO, 8 steps. First SIGUSR1 to the generator rank alone
    after step 2: its next rollout carries the request, the trainer stops after that step
    (checkpoint written) and tells the generator. The relaunch resumes, and SIGTERM to torchrun
    (forwarded to both ranks) stops it again; the third launch ends as an uninterrupted run,
    row for row. 8 steps, not 6: the generator rank runs a rollout ahead, so the first stop
    lands up to two steps after its signal, and with 6 steps the second signal could arrive
    after the last step (seen once in four fresh-clone runs: the run had ended, and the
    SIGTERM met its final barrier). Dynamic sampling runs on the generator rank (the same
    RolloutProducer.rollouts): flat groups are replaced by further rounds of prompts, and the
    trainer logs what it took."""
    steps = 8
    flags = (
        *("--job.config_file", DEBUG_TOML, "--generator.placement", "disaggregated"),
        *("--generator.verify_weight_sync", "true", "--algorithm.loss", "dapo"),
        *("--training.steps", str(steps), "--checkpoint.enable", "true"),
        *("--checkpoint.interval", "10"),
    )
    reference = tmp_path / "uninterrupted"
    result = run_train(*flags, "--job.dump_folder", str(reference), nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    for row in metric_rows(reference):
        assert row["policy_age/max"] == 0.0
        # The tiny model starts near reward 0: most groups are flat, so it takes more rounds.
        assert 1 < row["dynamic_sampling/rounds"] <= 4
        assert row["dynamic_sampling/generated_groups"] > 32
    out = tmp_path / "preempted"
    first = preempt(flags, out, after_step=2, sig=signal.SIGUSR1, rank=1)
    second = preempt(flags, out, after_step=first + 1, sig=signal.SIGTERM, rank=None)
    assert first < second < steps, (first, second)
    resumed = run_train(*flags, "--job.dump_folder", str(out), nproc=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {out / 'checkpoints' / f'step-{second}'}" in resumed.stdout
    assert_resumed_as(reference, out, first, exact=False)
    metrics = metric_rows(out)
    # After each resume the generator took the restored weights before sampling.
    versions = [max(s - 1, 0) for s in range(1, steps + 1)]
    assert [row["rollout_version/min"] for row in metrics] == versions
    assert {row["weight_sync/verified"] for row in metrics} == {1.0}


def test_an_engine_that_raises_on_one_rank_ends_the_run_at_once_with_one_line(tmp_path):
    """Rank 1's vLLM engine raises inside its step at step 2: one line names the step and the
    engine's error, the traceback is in rank 1's log, rank 0 does not wait out a timeout, the
    step-1 checkpoint is intact."""
    flags = (
        *("--job.config_file", DEBUG_TOML, "--training.steps", "4"),
        *("--checkpoint.enable", "true", "--checkpoint.interval", "1"),
        *("--job.hooks", "user_hooks:EngineRaisesOnRank1"),
    )
    ended = run_into(flags, tmp_path, 1, env=HOOKS_ENV)
    assert ended.returncode != 0
    assert errors(ended.stderr) == [
        "error: step 2: the generator's engine raised RuntimeError('injected fault: the KV "
        "cache is corrupt')"
    ]
    assert "torchtitan_rl/" not in ended.stderr  # no traceback of ours on the console
    assert ended.seconds < 30, ended.seconds
    log = (tmp_path / "run.rank1.log").read_text()
    assert re.search(r'File ".*user_hooks\.py", line \d+, in step_raises', log)
    # Rank 0 left at the alarm, or at the error of a collective with rank 1 gone: quietly.
    assert "watchdog: rank 1 stopped the run; " in (tmp_path / "run.log").read_text()
    assert invalid_reason(tmp_path / "checkpoints" / "step-1") is None
    assert_all_gone(ended.processes)


def test_a_dead_engine_process_ends_a_disaggregated_run_at_once_with_one_line(tmp_path):
    """The generator rank's engine process is SIGKILLed after step 2: the generator rank says
    so in one line naming the step, the trainer rank exits at once, no process is left."""
    flags = (
        *("--job.config_file", DEBUG_TOML, "--generator.placement", "disaggregated"),
        *("--training.steps", "20"),
    )

    def kill_the_engine(processes: list[psutil.Process]) -> None:
        rank_1 = next(p for p in processes if p.environ().get("RANK") == "1")
        engine = next(p for p in rank_1.children() if "spawn_main" in " ".join(p.cmdline()))
        engine.kill()

    ended = run_into(flags, tmp_path, 2, fault=kill_the_engine)
    assert ended.returncode != 0
    (line,) = errors(ended.stderr)
    assert re.fullmatch(
        r"error: step \d+: the generator's engine process died \(exit code -9\)", line
    ), line
    assert ended.seconds < 30, ended.seconds
    assert_all_gone(ended.processes)
