"""Shared test helpers: launching the train entry point and the scripts in tests/dist, as a plain
process (a world of one, nproc = 0) or under `torchrun --standalone` with nproc ranks."""

import os
import subprocess
import sys
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]


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


def kill_tree(process: subprocess.Popen) -> None:
    """SIGKILL a launcher and every process under it (torchrun puts each rank in a session
    of its own, so signalling its group is not enough)."""
    victims = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
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
    *flags: str, nproc: int = 0, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`python -m torchtitan_rl.train FLAGS` from the repo root; the result, not checked."""
    return _run([*launcher(nproc), "-m", "torchtitan_rl.train", *flags], env)


def start_train(*flags: str, nproc: int) -> subprocess.Popen:
    """Start `python -m torchtitan_rl.train FLAGS` in its own session (so that the test can
    signal it without signalling pytest); output goes to DEVNULL."""
    return subprocess.Popen(
        [*launcher(nproc), "-m", "torchtitan_rl.train", *flags],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        start_new_session=True,
    )


def run_dist(script: str, *args: str, nproc: int) -> subprocess.CompletedProcess:
    """Run tests/dist/`script` with `args`; fails the test on a non-zero exit."""
    result = _run([*launcher(nproc), str(REPO / "tests" / "dist" / script), *args], None)
    assert result.returncode == 0, result.stderr[-4000:]
    return result
