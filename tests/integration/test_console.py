"""The console shows this project's lines; library output goes to {job.dump_folder}/run.log.

.venv/bin/python -m pytest tests/test_console.py
"""

import subprocess
import sys
import textwrap

from helpers.launch import REPO, run_train

DEBUG_TOML = "run_configs/debug_cpu.toml"

# Seen on the console of a 2-rank CPU run before the redirect: torch's DTensor UserWarning,
# vLLM's "(MainProcess pid=...) WARNING" lines, a FutureWarning from vLLM's Triton shim,
# Triton's notice, the NUMA notice from C++ (fd 2), the tcmalloc hint, the shard-loading bar.
CHATTER = (
    "DTensor",
    "WARNING",
    "UserWarning",
    "FutureWarning",
    "Triton",
    "NUMA",
    "LD_PRELOAD",
    "Loading safetensors",
)


def test_verbose_shows_library_output_on_the_console(tmp_path):
    dump = tmp_path / "run"
    result = run_train(
        *("--job.config_file", DEBUG_TOML, "--training.steps", "1", "--job.verbose"),
        *("--job.dump_folder", str(dump)),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "DTensor random operators" in result.stderr
    assert ") WARNING " in result.stdout  # vLLM logs to stdout
    assert "step    1 | reward" in result.stdout
    assert not (dump / "run.log").exists()


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_redirect_sends_c_and_python_output_to_the_log_and_ours_to_both(tmp_path):
    (tmp_path / "run.rank1.log").write_text("an earlier run\n")
    result = run_python(f"""
        import os, sys, warnings
        from torchtitan_rl import console
        print("before", flush=True)
        console.redirect({str(tmp_path)!r}, rank=1)
        os.write(2, b"from C on fd 2\\n")
        os.write(1, b"from C on fd 1\\n")
        print("python print")
        warnings.warn("a library warning")
        console.say("ours on stdout")
        console.warn("warning: ours on stderr")
        console.error("error: ours")
        """)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "before\nours on stdout\n"
    assert result.stderr == "warning: ours on stderr\nerror: ours\n"
    log = (tmp_path / "run.rank1.log").read_text().splitlines()
    assert log[0] == "an earlier run"  # appended to, not replaced
    assert log[1:3] == ["from C on fd 2", "from C on fd 1"]
    assert log[3] == "python print"
    assert "UserWarning: a library warning" in log[4]
    assert log[-3:] == ["ours on stdout", "warning: ours on stderr", "error: ours"]
    assert not (tmp_path / "run.log").exists()


def test_an_unexpected_error_shows_its_traceback_and_points_at_the_log(tmp_path):
    # The failure is injected in place of the run (which would take a model and an engine).
    result = run_python(f"""
        import sys
        from torchtitan_rl import train

        def run(config, entry):
            raise RuntimeError("boom")

        train.run = run
        sys.exit(train.main(["--job.config_file", {DEBUG_TOML!r},
                             "--job.dump_folder", {str(tmp_path)!r}]))
        """)
    assert result.returncode == 1
    assert result.stdout.startswith("starting: library output goes to")
    lines = result.stderr.splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    assert "RuntimeError: boom" in lines
    assert lines[-1] == f"see {tmp_path / 'run.log'} for library output"
    assert "RuntimeError: boom" in (tmp_path / "run.log").read_text()
