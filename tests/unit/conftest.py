"""The unit tier launches no process: a test that tries fails with where it belongs."""

import subprocess

import pytest


class _NoProcess(subprocess.Popen):
    def __init__(self, args, *rest, **kwargs):
        raise AssertionError(
            f"a unit test launched {args!r}: tests that launch processes or build engines "
            "belong in tests/integration (tests/README.md)"
        )


@pytest.fixture(autouse=True)
def no_process_launched(monkeypatch):
    monkeypatch.setattr(subprocess, "Popen", _NoProcess)
