"""The console a user watches: this project's lines, warnings and errors. Library output (vLLM,
torch, Python warnings, C/C++ code writing straight to fd 2) goes to {job.dump_folder}/run.log.

    .venv/bin/python -m pytest tests/unit/test_console.py tests/integration/test_launcher.py

`redirect(folder, rank)` points this process's file descriptors 1 and 2 at the log (rank 0:
run.log, rank N: run.rank{N}.log, appended to), keeping copies of what they pointed at before.
`say` (stdout), `warn` and `error` (stderr) then write a line to that console and to the log.
Without a redirect (job.verbose, a dry run, code a test imports) they print to sys.stdout /
sys.stderr, so code calling them works everywhere.
"""

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO


@dataclass(frozen=True, slots=True)
class _Console:
    """Streams over copies of fds 1 and 2 taken before the redirect, and the log's path."""

    out: TextIO
    err: TextIO
    log: Path


_console: _Console | None = None


def log_name(rank: int) -> str:
    """The log file of `rank` in the dump folder."""
    return "run.log" if rank == 0 else f"run.rank{rank}.log"


def redirect(dump_folder: str | Path, rank: int) -> Path:
    """Send fds 1 and 2 of this process to its log in `dump_folder`; returns the log's path.

    dup2 rather than replacing sys.stdout/sys.stderr: C/C++ code (torch, vLLM's kernels, gloo)
    writes to the fds directly. sys.stdout and sys.stderr keep working (now into the log)."""
    global _console
    if _console is not None:
        return _console.log
    path = Path(dump_folder) / log_name(rank)
    # Whatever Python buffered so far belongs on the console, not in the log.
    sys.stdout.flush()
    sys.stderr.flush()
    out = _reopen(1)
    err = _reopen(2)
    log_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    # A file makes stdout block-buffered; line by line keeps the log in the order things happen.
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)
    _console = _Console(out=out, err=err, log=path)
    return path


def _reopen(fd: int) -> TextIO:
    """A line-buffered text stream over a copy of `fd` (what it points at now)."""
    return os.fdopen(os.dup(fd), "w", buffering=1, errors="backslashreplace")


def log_path() -> Path | None:
    """This process's log, or None when nothing was redirected."""
    return None if _console is None else _console.log


def terminal() -> TextIO:
    """The console's stderr (for a progress bar): the one the user sees, redirected or not."""
    return sys.stderr if _console is None else _console.err


def say(line: str) -> None:
    """`line` on the console's stdout, and in the log."""
    _write(line, sys.stdout, None if _console is None else _console.out)


def warn(line: str) -> None:
    """`line` on the console's stderr, and in the log."""
    _write(line, sys.stderr, None if _console is None else _console.err)


# The same channel as warn; its own name so that call sites read as what they report.
error = warn


def _write(line: str, stream: TextIO, console: TextIO | None) -> None:
    # `stream` is the log once redirected, the console itself otherwise.
    print(line, file=stream, flush=True)
    if console is not None:
        print(line, file=console, flush=True)
