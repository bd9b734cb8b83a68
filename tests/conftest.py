"""Shared test helpers: running the scripts in tests/dist under torchrun or as a plain process."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_dist(script: str, *args: str, nproc: int) -> subprocess.CompletedProcess:
    """Run tests/dist/`script` with `args` under `torchrun --standalone` with `nproc` ranks, or
    as a plain process (a world of one) for nproc = 0. Fails the test on a non-zero exit."""
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    result = subprocess.run(
        [
            sys.executable,
            *(launcher if nproc else []),
            str(REPO / "tests" / "dist" / script),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result
