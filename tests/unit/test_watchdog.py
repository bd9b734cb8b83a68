"""The watchdog in one process (a world of one): a phase that overruns, a signal that asks the
run to stop, the line each prints. The guard thread, its store and the signal pipe are real;
the process exit is recorded instead of taken (platform.exit_process), so the test goes on.

    .venv/bin/python -m pytest tests/unit/test_watchdog.py

With 2 ranks, a real hang, SIGTERM to torchrun and engine failures:
tests/integration/test_long_runs.py.
"""

import os
import queue
import signal
import threading

import pytest

from torchtitan_rl import platform, watchdog
from torchtitan_rl.watchdog import Phase, end_step, hang_line


@pytest.fixture
def exits(monkeypatch):
    """The codes the watchdog exits with."""
    codes = queue.Queue()

    def exit_process(code):
        codes.put(code)
        watchdog._watchdog.done.set()  # the guard thread ends where the process would

    monkeypatch.setattr(platform, "exit_process", exit_process)
    platform.init_distributed()  # a world of one
    yield codes
    watchdog.stop()
    signal.set_wakeup_fd(-1)
    for sig in watchdog.PREEMPTION_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)


def test_the_hang_line_names_the_stuck_ranks_and_where_the_others_wait():
    phases = {
        0: Phase(7, "weight_sync", since=105.0),
        1: Phase(7, "train", since=100.0),
        2: Phase(7, "train", since=101.0),
        # A generator rank waiting for weights since before: not what is stuck.
        3: Phase(8, "wait_weights", since=90.0, timed=False),
    }
    assert Phase.decode(phases[3].encode()) == phases[3]
    assert hang_line(60, phases, "out/run*.log") == (
        "error: step 7: ranks 1, 2 did not finish phase 'train' within job.phase_timeout_s = "
        "60 s (rank 0 in 'weight_sync' of step 7; rank 3 in 'wait_weights' of step 8); the "
        "Python stacks of every rank are in out/run*.log: raise job.phase_timeout_s if the "
        "phase is slow, not stuck"
    )


def test_a_phase_that_overruns_dumps_the_stacks_says_so_once_and_exits_124(exits, capfd):
    watchdog.start(0.5, checkpointing=True, log_hint="out/run*.log")
    watchdog.mark(3, "generate")
    watchdog.mark(3, "train")  # the phase that overruns
    assert exits.get(timeout=30) == watchdog.EXIT_HANG
    err = capfd.readouterr().err
    assert "watchdog: rank 0: a phase ran past job.phase_timeout_s; stacks:" in err
    # This thread's stack, waiting in the test, among every thread's.
    assert "in test_a_phase_that_overruns_dumps_the_stacks_says_so_once_and_exits_124" in err
    assert err.count("error: step 3: rank 0 did not finish phase 'train' within") == 1


def test_a_phase_within_the_timeout_and_an_untimed_wait_run_on(exits):
    watchdog.start(0.3, checkpointing=True, log_hint="-")
    for step in range(1, 11):  # 10 phases of 0.1 s: 1 s in all, none over 0.3 s
        watchdog.mark(step, "generate")
        assert exits.empty() or pytest.fail(f"exited at step {step}")
        threading.Event().wait(0.1)
    watchdog.mark(11, "wait_weights", timed=False)
    threading.Event().wait(0.8)
    assert exits.empty()


class Checkpoints:
    """What end_step asks of a checkpoint.Checkpointer, recorded (the real one saves in
    tests/unit/test_checkpoint.py and in the runs of test_long_runs.py)."""

    def __init__(self, enabled: bool, interval: int):
        self.enabled, self.interval, self.saved, self.closed = enabled, interval, [], False

    def should_save(self, step, last):
        return self.enabled and (last or step % self.interval == 0)

    def save(self, step):
        self.saved.append(step)

    def poll(self):
        pass

    def close(self):
        self.closed = True


def test_a_signal_stops_the_run_after_its_step_with_a_checkpoint_not_due(exits, tmp_path):
    watchdog.start(0, checkpointing=True, log_hint="-")  # 0: no phase timeout
    checkpoints = Checkpoints(enabled=True, interval=10)
    watchdog.mark(1, "generate")
    assert not end_step(checkpoints, 1, last=False, group=None)
    watchdog.mark(2, "train")
    os.kill(os.getpid(), signal.SIGUSR1)  # mid-step: the step goes on
    for _ in range(100):  # the handler runs at the main thread's next bytecode, the pipe's
        if watchdog.stop_requested():  # reader within a poll
            break
        threading.Event().wait(0.01)
    assert watchdog.stop_requested() == "SIGUSR1"
    assert end_step(checkpoints, 2, last=False, group=None)
    assert checkpoints.saved == [2] and checkpoints.closed
    checkpoints.folder = tmp_path
    assert watchdog.preempted_line(checkpoints, 2) == (
        f"step 2: stopped by SIGUSR1 (exit code 75): saved {tmp_path / 'step-2'}; launch the "
        "same command to resume"
    )
    assert exits.empty()


@pytest.mark.parametrize("started", [True, False])
def test_with_nothing_to_save_a_signal_exits_at_once_with_one_line(exits, capfd, started):
    """Checkpointing off (or no step run yet): no step to finish; exit 75 at once."""
    watchdog.start(0, checkpointing=not started, log_hint="-")
    if started:
        watchdog.mark(1, "train")
    os.kill(os.getpid(), signal.SIGTERM)
    assert exits.get(timeout=10) == watchdog.EXIT_PREEMPTED
    reason = (
        "checkpointing is off (checkpoint.enable = false)" if started else "no step has run yet"
    )
    assert capfd.readouterr().out == (
        f"stopped by SIGTERM (exit code 75): {reason}, so nothing was saved\n"
    )


def test_a_rank_that_fails_raises_the_alarm_and_a_peer_s_alarm_ends_this_rank(exits):
    watchdog.start(0, checkpointing=True, log_hint="-")
    watchdog.mark(1, "train")
    assert watchdog.fail() is None  # the first to fail: its own line goes on the console
    threading.Event().wait(1.5)  # the guard sees the alarm: its own, so it stays
    assert exits.empty()
    watchdog.stop()

    watchdog.start(0, checkpointing=True, log_hint="-")
    # Another rank of the same store (a world of one has a store of its own) fails first.
    watchdog._watchdog.store.compare_set("alarm", "", "failed 1")
    assert exits.get(timeout=10) == watchdog.EXIT_FAILED
    assert watchdog.fail() == "failed 1"  # this rank's error follows from rank 1's


def test_a_rank_whose_error_follows_a_hang_exits_as_the_hung_rank(capsys):
    """A rank's collective breaks when a hung peer exits first: it exits 124 as every rank of
    a hang does (torchrun then reports 124 for each), after a peer's failure 1."""
    from torchtitan_rl.launch import follows

    assert follows("hang", "RuntimeError: connection closed") == watchdog.EXIT_HANG
    assert follows("failed 1", "RuntimeError: connection closed") == 1
    err = capsys.readouterr().err
    assert "watchdog: a phase hung; then this rank got:\nRuntimeError" in err
    assert "watchdog: rank 1 stopped the run; then this rank got:" in err
