"""Fixtures of every test: the tier marker from the test's folder, and no process outliving
its test. Helpers live in tests/helpers/ (`from helpers.launch import run_train`); the runs that
integration tests share are in tests/integration/conftest.py."""

import ctypes
import os
import sys
from pathlib import Path

import psutil
import pytest

TESTS = Path(__file__).resolve().parent
TIERS = {TESTS / "unit": "unit", TESTS / "integration": "integration"}

# Orphans (a rank whose launcher died) are re-parented to this process instead of init, so
# the check below sees every process a test started, however it lost its parent.
if sys.platform.startswith("linux"):
    PR_SET_CHILD_SUBREAPER = 36
    ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1)


def pytest_collection_modifyitems(config, items):
    """Mark each test with its tier: the folder it lives in (tests/README.md)."""
    for item in items:
        path = Path(item.path)
        tier = next((name for folder, name in TIERS.items() if folder in path.parents), None)
        if tier is None:
            raise pytest.UsageError(f"{path}: tests live in tests/unit or tests/integration")
        item.add_marker(tier)


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


@pytest.fixture
def repo_cwd(monkeypatch):
    """Run from the repo root: run_configs name assets/ relative to it."""
    monkeypatch.chdir(TESTS.parent)
