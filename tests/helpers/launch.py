"""Launching what the integration tests run: the entry points, scripts/ and tests/dist/, as a
plain process (a world of one, nproc = 0) or under `torchrun --standalone` with nproc ranks;
reading what a run wrote; and killing a run with everything under it.

Every launch runs from the repo root with OMP_NUM_THREADS=1, the repo root and tests/ on
PYTHONPATH (tests/dist scripts import this checkout's torchtitan_rl and `helpers.*`), in a
session of its own (a test signals it without signalling pytest).
"""

import atexit
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from helpers import forkserver
from helpers.environ import AT_START

from torchtitan_rl.metrics import TIMING_METRICS

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
HELPERS = str(TESTS / "helpers")
DEBUG_TOML = "run_configs/debug_cpu.toml"
TINY = str(REPO / "assets" / "tiny_qwen3")
# Wall-clock figures differ between runs; every other metric of a resumed run must not.
TIMING = TIMING_METRICS


def launcher(nproc: int, forked: bool = True) -> list[str]:
    """The command prefix: python, or torchrun with `nproc` ranks on a free port. `forked`:
    python is this worker's fork server (forkserver.py), whose processes have torch, vLLM and
    torchtitan_rl imported already; a test that looks at its ranks' processes (their children,
    a rank killed) passes False."""
    python = [FORKED] if forked and _forkserver() else [sys.executable]
    if not nproc:
        return python
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    torchrun += ["--nproc_per_node", str(nproc)]
    return [*torchrun, "--no-python", *python, "-u"] if python == [FORKED] else torchrun


FORKED = str(TESTS / "helpers" / "forked")
_server: dict = {}  # the fork server of this process: its "process" and "socket"


def _forkserver() -> bool:
    """Start this process's fork server unless it runs (or TTRL_FORKSERVER=0); whether there
    is one. It listens at once and imports for ~15 s: the first launches wait for it."""
    if os.environ.get(forkserver.SOCKET) == "0":
        return False
    if not _server:
        folder = Path(tempfile.mkdtemp(prefix="forkserver-"))
        path = folder / "socket"
        log = (folder / "server.log").open("w")
        process = subprocess.Popen(
            [sys.executable, "-m", "helpers.forkserver", "--serve", str(path)],
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=_environment(),
            start_new_session=True,
        )
        deadline = time.monotonic() + 60
        while not path.exists():
            assert process.poll() is None, (folder / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the fork server did not listen in 60 s"
            time.sleep(0.01)
        _server.update(process=process, socket=str(path))
        atexit.register(process.kill)
    return True


def forkserver_pid() -> int | None:
    """The pid of this process's fork server, if it runs (tests/conftest.py spares it)."""
    return _server["process"].pid if _server else None


def processes_below() -> list[psutil.Process]:
    """Every process under this one but its fork server (whose children are included)."""
    server = forkserver_pid()
    return [p for p in psutil.Process().children(recursive=True) if p.pid != server]


def _environment(env: dict[str, str] | None = None) -> dict[str, str]:
    paths = [p for p in ((env or {}).get("PYTHONPATH"), str(REPO), str(TESTS)) if p]
    return {
        **AT_START,
        "OMP_NUM_THREADS": "1",
        **(env or {}),
        "PYTHONPATH": os.pathsep.join(paths),
    }


def environment(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment pytest started with (helpers/environ.py), not os.environ as in-process
    tests left it, with one thread per rank, this checkout and tests/ importable, and `env` on
    top (a PYTHONPATH in `env` comes first); and where the fork server listens."""
    if not _server:
        return _environment(env)
    server = {forkserver.SOCKET: _server["socket"], forkserver.PYTHON: sys.executable}
    return {**_environment(env), **server}


def write_toml(tmp_path: Path, text: str) -> str:
    """`text` as tmp_path/run.toml; returns its path."""
    path = tmp_path / "run.toml"
    path.write_text(text)
    return str(path)


def _kind(row: dict) -> str:
    return "eval" if "eval/accuracy" in row or "eval/loss" in row else "train"


def metric_rows(folder: Path, kind: str = "train") -> list[dict]:
    """folder/metrics.jsonl rows of one kind: "train" (step rows), "eval" (rows with
    eval/accuracy or eval/loss), or "all"."""
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if kind in ("all", _kind(row))]


def keyed_rows(folder: Path) -> list[tuple[tuple[int, str], dict]]:
    """folder/metrics.jsonl rows in file order, each keyed by (step, "train" or "eval")."""
    return [((row["step"], _kind(row)), row) for row in metric_rows(folder, "all")]


def logged_steps(folder: Path) -> set[int]:
    """Steps in folder/metrics.jsonl so far (none yet, or a last line still being written)."""
    steps = set()
    path = folder / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            steps.add(json.loads(line)["step"])
        except ValueError:
            pass  # a line being written
    return steps


def assert_resumed_as(reference: Path, resumed: Path, resumed_from: int, exact: bool) -> None:
    """The run in `resumed`, stopped and resumed from step `resumed_from`, logged what the
    uninterrupted run in `reference` did: the same rows (none missing or doubled), every
    non-timing metric after `resumed_from` equal (`exact`) or within 1e-6, and, when both
    exported, the same final weights bit for bit."""
    import pytest
    import torch
    from safetensors.torch import load_file

    expected, got = keyed_rows(reference), keyed_rows(resumed)
    assert [key for key, _ in got] == [key for key, _ in expected]
    got = dict(got)
    for key, row in expected:
        if key[0] <= resumed_from:
            continue
        for metric, value in row.items():
            if metric.startswith(TIMING):
                continue
            if exact:
                assert got[key][metric] == value, (key, metric)
            else:
                assert got[key][metric] == pytest.approx(value, rel=1e-6, abs=1e-7), (key, metric)
    if (reference / "hf").is_dir() or (resumed / "hf").is_dir():
        final, uninterrupted = (load_file(f / "hf/model.safetensors") for f in (resumed, reference))
        assert final.keys() == uninterrupted.keys()
        for name, tensor in uninterrupted.items():
            assert torch.equal(final[name], tensor), name


def wait_for_step(process: subprocess.Popen, folder: Path, step: int) -> None:
    """Poll (every 5 ms) until the run in `folder` has logged `step`; fail if it ends first."""
    deadline = time.monotonic() + 300
    while step not in logged_steps(folder):
        assert process.poll() is None, f"the run ended before step {step}"
        assert time.monotonic() < deadline, f"the run did not reach step {step} in 300 s"
        time.sleep(0.005)


def kill_tree(process: subprocess.Popen) -> None:
    """SIGKILL a launcher and every process under it (torchrun puts each rank in a session
    of its own, so signalling its group is not enough)."""
    try:
        root = psutil.Process(process.pid)
        victims = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return  # already gone (its orphans, if any, are pytest's children: tests/conftest.py)
    for victim in victims:
        try:
            victim.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(victims, timeout=30)


def start_piped(command: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start `command` from the repo root, its stdout and stderr piped as text."""
    return subprocess.Popen(
        command,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=environment(env),
        start_new_session=True,
    )


def run(
    command: list[str], env: dict[str, str] | None = None, timeout_s: float = 600
) -> subprocess.CompletedProcess:
    """Run `command` from the repo root; the result, not checked. A command still running
    after `timeout_s` is killed with everything under it."""
    process = start_piped(command, env)
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_tree(process)  # no rank outlives its test
        raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def preempt(
    flags: tuple[str, ...],
    out: Path,
    after_step: int,
    sig: signal.Signals,
    rank: int | None,
    module: str = "torchtitan_rl.train",
) -> int:
    """Launch `module` with 2 ranks, and once `after_step` is logged send `sig` to torchrun
    (rank None), which forwards it to every rank, or to one rank. The run must finish its step,
    write a complete checkpoint, say so in one line and end, every rank gone; returns the step
    it stopped after (watchdog.py)."""
    from torchtitan_rl.checkpoint import invalid_reason
    from torchtitan_rl.watchdog import EXIT_PREEMPTED

    command = [
        *launcher(2),
        "-m",
        module,
        *flags,
        "--job.dump_folder",
        str(out),
    ]
    process = start_piped(command)
    try:
        wait_for_step(process, out, after_step)
        ranks = psutil.Process(process.pid).children(recursive=True)
        if rank is None:
            process.send_signal(sig)
        else:
            next(p for p in ranks if p.environ().get("RANK") == str(rank)).send_signal(sig)
        stdout, stderr = process.communicate(timeout=60)  # torchrun's grace period: 30 s
    finally:
        kill_tree(process)
    stops = re.findall(
        rf"^step (\d+): stopped by {sig.name} \(exit code 75\): saved (.*); launch the same "
        "command to resume$",
        stdout,
        re.M,
    )
    assert len(stops) == 1, stdout + stderr[-3000:]
    step, saved = int(stops[0][0]), Path(stops[0][1])
    assert saved == out / "checkpoints" / f"step-{step}" and invalid_reason(saved) is None
    assert step >= after_step
    if rank is not None:  # torchrun, not signalled itself, reports every rank's exit code
        assert stderr.count(f"exitcode  : {EXIT_PREEMPTED} ") == 2, stderr[-3000:]
    assert "SIGKILL" not in stderr  # every rank was done within torchrun's grace period
    assert not [p for p in ranks if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    return step


def run_train(
    *flags: str,
    nproc: int = 0,
    env: dict[str, str] | None = None,
    module: str = "torchtitan_rl.train",
) -> subprocess.CompletedProcess:
    """`python -m torchtitan_rl.train FLAGS` (or `module`); the result, not checked. The
    engine is the default, compiled, as users run it."""
    return run([*launcher(nproc), "-m", module, *flags], env)


def start_train(*flags: str, nproc: int, module: str = "torchtitan_rl.train") -> subprocess.Popen:
    """Start `python -m torchtitan_rl.train FLAGS` (or `module`) without waiting; its output
    goes to DEVNULL."""
    return subprocess.Popen(
        [*launcher(nproc), "-m", module, *flags],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=environment(),
        start_new_session=True,
    )


def run_script(
    script: str, *args: str, nproc: int = 0, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run scripts/`script` with `args`; the result, not checked."""
    return run([*launcher(nproc), str(REPO / "scripts" / script), *args], env)


def run_dist(
    script: str,
    *args: str,
    nproc: int,
    env: dict[str, str] | None = None,
    timeout_s: float = 600,
) -> subprocess.CompletedProcess:
    """Run tests/dist/`script` with `args`; fails the test on a non-zero exit."""
    result = run([*launcher(nproc), str(TESTS / "dist" / script), *args], env, timeout_s)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def run_helper(script: str, *args: str) -> subprocess.CompletedProcess:
    """Run tests/helpers/`script` as python would (forked: `launcher(0)`; 300 s at most);
    fails the test on a non-zero exit."""
    result = run([*launcher(0), str(TESTS / "helpers" / script), *args], timeout_s=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return result
