"""What keeps a long run honest on a shared cluster: a phase watchdog, preemption that saves,
and peers that stop with a failed rank. One guard thread per rank.

    .venv/bin/python -m pytest tests/unit/test_watchdog.py tests/integration/test_long_runs.py

- **Hangs.** The loop marks each phase of a step (`mark(step, "generate")`, ...). A phase that
  runs past job.phase_timeout_s on any rank: every rank writes the Python stacks of all its
  threads to its run log (faulthandler), the rank that saw it prints one line naming the step,
  the phase and the ranks that had not finished it, and every rank exits with EXIT_HANG.
- **Preemption.** SIGTERM or SIGUSR1 asks the run to stop: the loop finishes its step, every
  rank agrees (`preempted`, a collective at the step's end), a checkpoint is written even when
  checkpoint.interval is not due, and the run exits with EXIT_PREEMPTED. With checkpointing
  off, or before the first step, there is nothing to finish: one line, and it exits at once.
- **A failed rank.** A rank that stops (an error, a crash) raises the alarm in the store
  (`fail`); the others exit at once with code 1, instead of waiting out a collective's
  timeout, and an error that follows from it (a collective with that rank gone) stays in
  their logs.

The guard thread reads signals through a wakeup pipe (`signal.set_wakeup_fd`): Python runs a
signal handler only when the main thread is between bytecodes, and a rank stuck in a collective
or a kernel never is. Ranks meet in the torchrun store (a client of its own, off the main
thread); a world of one uses a local store.
"""

import faulthandler
import os
import select
import signal
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from torchtitan_rl import console, platform
from torchtitan_rl.errors import StopRun

EXIT_HANG = 124
"""A phase ran past job.phase_timeout_s (as `timeout(1)` exits)."""
EXIT_PREEMPTED = 75
"""Stopped by SIGTERM/SIGUSR1 after a checkpoint (EX_TEMPFAIL: relaunch to resume)."""
EXIT_FAILED = 1
"""A peer rank stopped the run (its own line says why)."""
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# How long the ranks of a hang wait for one another's stacks before they exit.
DUMP_WAIT_S = 10.0


class Preempted(StopRun):
    """The run stopped on a signal, after its step and checkpoint; relaunching resumes it."""


@dataclass(frozen=True, slots=True)
class Phase:
    """Where a rank is: `name` of `step`, entered at `since` (time.time(), comparable across
    hosts to a clock's skew)."""

    step: int
    name: str
    since: float
    timed: bool = True
    """False for a phase that only waits for other ranks' timed phases (a generator rank
    waiting for the trainers' weights): theirs catch a hang."""

    def encode(self) -> bytes:
        return f"{self.step}|{self.name}|{self.since!r}|{int(self.timed)}".encode()

    @classmethod
    def decode(cls, data: bytes) -> "Phase":
        step, name, since, timed = data.decode().split("|")
        return cls(int(step), name, float(since), bool(int(timed)))


def laggards(phases: dict[int, Phase]) -> tuple[Phase, list[int]]:
    """The phase the run is stuck in (the one entered first) and the ranks still in it."""
    oldest = min((p for p in phases.values() if p.timed), key=lambda p: p.since)
    stuck = [r for r, p in sorted(phases.items()) if (p.step, p.name) == (oldest.step, oldest.name)]
    return oldest, stuck


def hang_line(timeout_s: float, phases: dict[int, Phase], log_hint: str) -> str:
    """The one console line of a hang: the stuck phase, its ranks, where the others wait."""
    oldest, stuck = laggards(phases)
    ranks = ", ".join(map(str, stuck))
    others = [f"rank {r} in '{p.name}' of step {p.step}" for r, p in sorted(phases.items())]
    others = [o for r, o in zip(sorted(phases), others, strict=True) if r not in stuck]
    waiting = f" ({'; '.join(others)})" if others else ""
    return (
        f"error: step {oldest.step}: rank{'s' if len(stuck) > 1 else ''} {ranks} did not finish "
        f"phase '{oldest.name}' within job.phase_timeout_s = {timeout_s:g} s{waiting}; the "
        f"Python stacks of every rank are in {log_hint}: raise job.phase_timeout_s if the phase "
        "is slow, not stuck"
    )


class Watchdog:
    """This rank's guard: the phase it is in, the signals it got, the store it meets peers in."""

    def __init__(self, *, timeout_s: float, checkpointing: bool, log_hint: str):
        self.timeout_s, self.checkpointing, self.log_hint = timeout_s, checkpointing, log_hint
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.store = _store(self.world)
        self.phase: Phase | None = None
        """Where the loop is; None before its first `mark`."""
        self.entered = time.monotonic()
        """When this rank entered its phase (the monotonic clock, for the timeout)."""
        self.published: Phase | None = None
        self.signal: str | None = None
        self.hanging = False
        """Set once this rank exits for a hang: a signal then changes nothing (torchrun sends
        SIGTERM to the ranks still up when the first one exits)."""
        self.poll_s = min(1.0, timeout_s / 10) if timeout_s else 1.0
        self.done = threading.Event()
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.write_fd, False)
        self.thread = threading.Thread(target=self._guard, name="watchdog", daemon=True)

    def start(self) -> None:
        """Take SIGTERM/SIGUSR1 (main thread only) and start the guard thread."""
        for sig in PREEMPTION_SIGNALS:
            signal.signal(sig, self._on_signal)
        signal.set_wakeup_fd(self.write_fd, warn_on_full_buffer=False)
        self.thread.start()

    def stop(self) -> None:
        self.done.set()
        os.write(self.write_fd, b"\0")  # wake the guard from its poll
        self.thread.join(timeout=5)

    def _on_signal(self, signum, frame) -> None:
        # Runs in the main thread when it can; the guard thread has seen the pipe already.
        self._requested(signal.Signals(signum).name)

    def _requested(self, name: str) -> None:
        if self.signal is not None or self.hanging:
            return
        self.signal = name
        # No phase marked yet: no step to finish.
        if self.phase is None or not self.checkpointing:
            reason = (
                "no step has run yet"
                if self.phase is None
                else "checkpointing is off (checkpoint.enable = false)"
            )
            line = f"stopped by {name} (exit code {EXIT_PREEMPTED}): {reason}, so nothing was saved"
            self._say_once("preempted", line, console.say)
            platform.exit_process(EXIT_PREEMPTED)

    # ---- the guard thread ----

    def _guard(self) -> None:
        while not self.done.is_set():
            ready, _, _ = select.select([self.read_fd], [], [], self.poll_s)
            if ready:
                for byte in os.read(self.read_fd, 64):
                    if byte in [int(s) for s in PREEMPTION_SIGNALS]:
                        self._requested(signal.Signals(byte).name)
            try:
                self._check()
            except Exception as e:  # a store gone (torchrun tearing down): nothing to guard
                print(f"watchdog: stopped checking ({e!r})", file=sys.stderr, flush=True)
                return

    def _check(self) -> None:
        phase = self.phase
        if phase is not None and phase is not self.published:
            self.store.set(f"phase/{self.rank}", phase.encode())
            self.published = phase
        overran = bool(self.timeout_s) and phase is not None and phase.timed
        overran = overran and time.monotonic() - self.entered > self.timeout_s
        if overran:
            _raise_alarm(self.store, "hang")
        alarm = self.store.get("alarm").decode() if self.store.check(["alarm"]) else None
        if alarm == "hang":
            self._hang(saw_it=overran)
        elif alarm is not None and alarm != f"failed {self.rank}":  # a peer's "failed R"
            print(f"watchdog: {what_happened(alarm)}; exiting", file=sys.stderr, flush=True)
            platform.exit_process(EXIT_FAILED)

    def _hang(self, saw_it: bool) -> None:
        """Dump this rank's stacks, wait (bounded) for the others', say it once, exit."""
        self.hanging = True
        header = f"watchdog: rank {self.rank}: a phase ran past job.phase_timeout_s; stacks:\n"
        sys.stderr.write(header)
        sys.stderr.flush()
        faulthandler.dump_traceback(file=2, all_threads=True)  # fd 2: the run log
        self.store.add("dumped", 1)
        deadline = time.monotonic() + DUMP_WAIT_S
        while self.store.add("dumped", 0) < self.world and time.monotonic() < deadline:
            time.sleep(0.1)
        if saw_it:
            phases = {r: Phase.decode(self.store.get(f"phase/{r}")) for r in self._published()}
            self._say_once("hang", hang_line(self.timeout_s, phases, self.log_hint), console.error)
        platform.exit_process(EXIT_HANG)

    def _published(self) -> list[int]:
        return [r for r in range(self.world) if self.store.check([f"phase/{r}"])]

    def _say_once(self, what: str, line: str, say) -> None:
        """`line` on the console (`say`) from the first rank to get here; the others log it."""
        if self.store.add(f"said/{what}", 1) == 1:
            say(line)
        else:
            print(line, file=sys.stderr, flush=True)


_watchdog: Watchdog | None = None


def start(timeout_s: float, checkpointing: bool, log_hint: str) -> None:
    """Start this rank's watchdog (once the process group is up): phases unwatched until the
    first `mark`; 0 s watches none."""
    global _watchdog
    if _watchdog is None:
        _watchdog = Watchdog(timeout_s=timeout_s, checkpointing=checkpointing, log_hint=log_hint)
        _watchdog.start()


def stop() -> None:
    """Stop watching (the run ended)."""
    global _watchdog
    if _watchdog is not None:
        _watchdog.stop()
        _watchdog = None


def mark(step: int, phase: str, timed: bool = True) -> None:
    """This rank enters `phase` of `step` (`timed`: bounded by job.phase_timeout_s)."""
    if _watchdog is not None:
        # The wall clock orders phases across ranks; a clock's step must not time one out.
        _watchdog.entered = time.monotonic()
        _watchdog.phase = Phase(step, phase, time.time(), timed)


def request_stop(reason: str) -> None:
    """Ask the run to stop at the end of this step, as a signal does (a generator rank's
    request, arriving with its rollout)."""
    if _watchdog is not None and _watchdog.signal is None:
        _watchdog.signal = reason


def stop_requested() -> str | None:
    """The signal this rank got, if any."""
    return None if _watchdog is None else _watchdog.signal


def end_step(checkpointer, step: int, *, last: bool, group: dist.ProcessGroup | None) -> bool:
    """The end of every step of a loop: write the checkpoint when it is due, or when any rank
    of `group` was asked to stop (checkpoint.Checkpointer); returns whether the run stops now,
    its checkpoint complete."""
    mark(step, "checkpoint")
    stopping = preempted(group)
    if checkpointer.should_save(step, last=last) or (stopping and checkpointer.enabled):
        checkpointer.save(step)
    checkpointer.poll()
    if stopping:
        checkpointer.close()
    return stopping


def preempted_line(checkpointer, step: int) -> str:
    """What a preempted run says when it stops after `step`."""
    saved = (
        f"saved {checkpointer.folder / f'step-{step}'}; launch the same command to resume"
        if checkpointer.enabled
        else "checkpointing is off (checkpoint.enable = false), so nothing was saved"
    )
    return f"step {step}: stopped by {stop_requested()} (exit code {EXIT_PREEMPTED}): {saved}"


def preempted(group: dist.ProcessGroup | None) -> bool:
    """Whether any rank of `group` was asked to stop: a collective, at the same point of every
    rank's step, so that all stop after the same step."""
    asked = torch.tensor([float(stop_requested() is not None)])
    platform.all_reduce_host(asked, op=dist.ReduceOp.MAX, group=group)
    return bool(asked)


def fail() -> str | None:
    """This rank stops the run: raise the alarm, so that the other ranks exit at once. Returns
    the alarm a peer raised before ("failed R", "hang"): then this rank's error follows from
    that one (a collective with a rank gone), and only the peer's line belongs on the console."""
    if _watchdog is None:
        return None
    mine = f"failed {_watchdog.rank}"
    try:
        alarm = _raise_alarm(_watchdog.store, mine)
    except Exception:  # the store is gone: torchrun is tearing the world down anyway
        return None
    return None if alarm == mine else alarm


def what_happened(alarm: str) -> str:
    """The run's alarm ("hang", or "failed R") in words."""
    return "a phase hung" if alarm == "hang" else f"rank {alarm.split()[1]} stopped the run"


def _raise_alarm(store: dist.Store, alarm: str) -> str:
    """Set the run's alarm ("hang", or "failed R") unless one is set: the first one stands,
    and is returned."""
    return store.compare_set("alarm", "", alarm).decode()


def _store(world: int) -> dist.Store:
    """A store client of the guard's own: the torchrun store, under this attempt's prefix."""
    if world == 1 or "MASTER_ADDR" not in os.environ:
        return dist.HashStore()
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=60),
        wait_for_workers=False,
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "run")
    return dist.PrefixStore(f"torchtitan_rl/watchdog/{run_id}/{attempt}", store)
