"""The unit tier launches no Python process (no entry point, script or torchrun world): a
test that tries fails with where it belongs. Libraries may still probe the system (cpuinfo, on
import, runs `file -b python`)."""

import os
import subprocess
import sys

import pytest


def _runs_python(args) -> bool:
    argv = [args] if isinstance(args, str | os.PathLike) else list(args)
    program = os.path.basename(str(argv[0]).split()[0]) if argv else ""
    return str(argv[0]) == sys.executable or program.startswith(("python", "torchrun"))


class _NoPythonProcess(subprocess.Popen):
    def __init__(self, args, *rest, **kwargs):
        if _runs_python(args):
            raise AssertionError(
                f"a unit test launched {args!r}: tests that launch processes or build engines "
                "belong in tests/integration (tests/README.md)"
            )
        super().__init__(args, *rest, **kwargs)


@pytest.fixture(autouse=True)
def no_python_process_launched(monkeypatch):
    monkeypatch.setattr(subprocess, "Popen", _NoPythonProcess)
