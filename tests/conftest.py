"""Shared test helpers: launching the train entry point and the scripts in tests/dist, as a plain
process (a world of one, nproc = 0) or under `torchrun --standalone` with nproc ranks."""

import ctypes
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]
DEBUG_TOML = str(REPO / "run_configs" / "debug_cpu.toml")
TINY = str(REPO / "assets" / "tiny_qwen3")

# Orphans (a rank whose launcher died) are re-parented to this process instead of init, so
# the check below sees every process a test started, however it lost its parent.
if sys.platform.startswith("linux"):
    PR_SET_CHILD_SUBREAPER = 36
    ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1)


def _reap() -> None:
    """Collect exited orphans (they are this process's children now)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


@pytest.fixture(autouse=True)
def no_process_outlives_its_test():
    """Every test ends with no process of its own still running (they are killed, and the
    test fails)."""
    yield
    _reap()
    alive = {}
    for process in psutil.Process().children(recursive=True):
        try:
            if process.status() != psutil.STATUS_ZOMBIE:
                alive[process] = " ".join(process.cmdline()[:4])
                process.kill()
        except psutil.NoSuchProcess:
            pass  # ended while we looked
    psutil.wait_procs(list(alive), timeout=30)
    _reap()
    assert not alive, f"processes left running: {list(alive.values())}"


def launcher(nproc: int) -> list[str]:
    """The command prefix: python, or torchrun with `nproc` ranks on a free port."""
    if not nproc:
        return [sys.executable]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(nproc),
    ]


@pytest.fixture
def repo_cwd(monkeypatch):
    """Run from the repo root: run_configs name assets/ relative to it."""
    monkeypatch.chdir(REPO)


def write_toml(tmp_path: Path, text: str) -> str:
    """`text` as tmp_path/run.toml; returns its path."""
    path = tmp_path / "run.toml"
    path.write_text(text)
    return str(path)


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
        return  # already gone (its orphans, if any, are this process's children: see above)
    for victim in victims:
        try:
            victim.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(victims, timeout=30)


def _run(command: list[str], env: dict[str, str] | None) -> subprocess.CompletedProcess:
    process = subprocess.Popen(
        command,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        kill_tree(process)  # no rank outlives its test
        raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def run_train(
    *flags: str,
    nproc: int = 0,
    env: dict[str, str] | None = None,
    module: str = "torchtitan_rl.train",
) -> subprocess.CompletedProcess:
    """`python -m torchtitan_rl.train FLAGS` (or `module`) from the repo root; the result,
    not checked."""
    return _run([*launcher(nproc), "-m", module, *flags], env)


def start_train(*flags: str, nproc: int, module: str = "torchtitan_rl.train") -> subprocess.Popen:
    """Start `python -m torchtitan_rl.train FLAGS` (or `module`) in its own session (so that
    the test can signal it without signalling pytest); output goes to DEVNULL."""
    return subprocess.Popen(
        [*launcher(nproc), "-m", module, *flags],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        start_new_session=True,
    )


def run_script(script: str, *args: str, nproc: int = 0) -> subprocess.CompletedProcess:
    """Run scripts/`script` with `args` from the repo root; the result, not checked."""
    return _run([*launcher(nproc), str(REPO / "scripts" / script), *args], None)


def run_dist(script: str, *args: str, nproc: int) -> subprocess.CompletedProcess:
    """Run tests/dist/`script` with `args`; fails the test on a non-zero exit."""
    result = _run([*launcher(nproc), str(REPO / "tests" / "dist" / script), *args], None)
    assert result.returncode == 0, result.stderr[-4000:]
    return result
