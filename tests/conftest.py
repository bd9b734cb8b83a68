"""Shared test helpers: launching the train entry point and the scripts in tests/dist, as a plain
process (a world of one, nproc = 0) or under `torchrun --standalone` with nproc ranks."""

import os
import subprocess
import sys
from pathlib import Path

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


def _run(command: list[str], env: dict[str, str] | None) -> subprocess.CompletedProcess:
    return subprocess.run(
        command,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )


def run_train(
    *flags: str, nproc: int = 0, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`python -m torchtitan_rl.train FLAGS` from the repo root; the result, not checked."""
    return _run([*launcher(nproc), "-m", "torchtitan_rl.train", *flags], env)


def run_dist(script: str, *args: str, nproc: int) -> subprocess.CompletedProcess:
    """Run tests/dist/`script` with `args`; fails the test on a non-zero exit."""
    result = _run([*launcher(nproc), str(REPO / "tests" / "dist" / script), *args], None)
    assert result.returncode == 0, result.stderr[-4000:]
    return result
