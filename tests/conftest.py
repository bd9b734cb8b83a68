"""Fixtures of every test: the tier marker from the test's folder, and no process outliving
its test. Helpers live in tests/helpers/ (`from helpers.launch import run_train`); the runs that
integration tests share are in tests/integration/conftest.py."""

import ctypes
import os
import sys
from pathlib import Path

import psutil
import pytest
from helpers.environ import AT_START  # noqa: F401 - first: before test code sets variables

TESTS = Path(__file__).resolve().parent
TIERS = {TESTS / "unit": "unit", TESTS / "integration": "integration"}

# Orphans (a rank whose launcher died) are re-parented to this process instead of init, so
# the check below sees every process a test started, however it lost its parent.
if sys.platform.startswith("linux"):
    PR_SET_CHILD_SUBREAPER = 36
    ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1)


@pytest.hookimpl(tryfirst=True)  # before xdist's worker reads the groups into the node ids
def pytest_collection_modifyitems(config, items):
    """Mark each test with its tier: the folder it lives in (tests/README.md); and with the
    xdist group of the runs it shares (`_share_groups`)."""
    for item in items:
        path = Path(item.path)
        tier = next((name for folder, name in TIERS.items() if folder in path.parents), None)
        if tier is None:
            raise pytest.UsageError(f"{path}: tests live in tests/unit or tests/integration")
        item.add_marker(tier)
    _share_groups(items)


def _shared(item) -> set[str]:
    """What `item` shares with other tests: the session-scoped fixtures of this suite it uses
    (statically, or through request.getfixturevalue: its `shares` marks), and its module where
    it uses a module-scoped fixture of this suite."""
    shared, seen = set(), set()
    pending = [*item.fixturenames, *(n for mark in item.iter_markers("shares") for n in mark.args)]
    while pending:
        name = pending.pop()
        definitions = item.session._fixturemanager.getfixturedefs(name, item)
        if name in seen or not definitions:
            continue
        seen.add(name)
        definition = definitions[-1]
        if TESTS not in Path(definition.func.__code__.co_filename).parents:
            continue  # pytest's own (tmp_path_factory) or a plugin's
        pending.extend(definition.argnames)  # and the fixtures it uses
        if definition.scope == "session":
            shared.add(name)
        elif definition.scope == "module":
            shared.add(str(item.path))
    return shared


def _share_groups(items) -> None:
    """Under `pytest -n 2 --dist loadgroup` (scripts/test.sh), keep the tests that share a
    session or module fixture on one worker, so that each shared run starts once: the tests
    linked through what they share (`_shared`) get one xdist group, as do a module's tests
    marked with their own `xdist_group`; the rest go wherever a worker is free."""
    parent: dict[str, str] = {}

    def root(node: str) -> str:
        while parent.setdefault(node, node) != node:
            node = parent[node]
        return node

    shares = {item.nodeid: sorted(_shared(item)) for item in items}
    for names in shares.values():
        for name in names[1:]:
            parent[root(name)] = root(names[0])
    for item in items:
        group = None
        if shares[item.nodeid]:
            group = Path(root(shares[item.nodeid][0])).name
            item.add_marker(pytest.mark.xdist_group(group))
        elif (mark := item.get_closest_marker("xdist_group")) is not None:
            group = mark.args[0]  # a module's own group (one worker pays its imports)
        if group is not None:
            if os.environ.get("PYTEST_XDIST_WORKER") and not item.nodeid.endswith(f"@{group}"):
                # xdist 3.8 tells its scheduler the group by a "@group" suffix it writes to
                # item._nodeid, which pytest 9 no longer reads (the id is item._id): write it
                # where pytest 9 keeps it. (An "@" in a parameter's id is no suffix: xdist
                # reads one only after the last "]".)
                from _pytest.nodeid import NodeId

                item._id = NodeId.parse(f"{item.nodeid}@{group}")


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
    launch = sys.modules.get("helpers.launch")
    server = launch.forkserver_pid() if launch else None  # it outlives them: its children don't
    for process in psutil.Process().children(recursive=True):
        if process.pid == server:
            continue
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
