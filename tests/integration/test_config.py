"""JobConfig through the entry point as a process: exit code 2 with one line, the dry run's
TOML round trip, --help. In process: tests/unit/test_config.py.

    .venv/bin/python -m pytest tests/integration/test_config.py
"""

import dataclasses
import tomllib

import pytest
from helpers.launch import DEBUG_TOML, TINY, run_train, write_toml

from torchtitan_rl.config import JobConfig

# run_configs name assets/ relative to the repo root, as the README's commands do.
pytestmark = pytest.mark.usefixtures("repo_cwd")


def test_process_exits_2_with_one_line_and_no_traceback(tmp_path):
    path = write_toml(tmp_path, "[training]\nsteps = -3\n")
    result = run_train("--job.config_file", path, "--model.hf_checkpoint", TINY)
    assert result.returncode == 2
    assert result.stderr == "error: training.steps = -3: must be >= 1\n"
    assert result.stdout == ""

    result = run_train("--job.config_file", DEBUG_TOML, "--training.steps", "x")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


def test_dry_run_prints_toml_and_round_trips(tmp_path):
    dump = tmp_path / "dump"
    first = run_train(
        "--job.config_file",
        DEBUG_TOML,
        "--job.dry_run",
        "--training.steps",
        "7",
        "--job.dump_folder",
        str(dump),
    )
    assert first.returncode == 0, first.stderr
    assert "steps = 7" in first.stdout
    parsed = tomllib.loads(first.stdout)
    assert parsed["training"]["steps"] == 7 and "config_file" not in parsed["job"]
    assert not dump.exists()  # a dry run builds and writes nothing

    fed_back = write_toml(tmp_path, first.stdout)
    second = run_train("--job.config_file", fed_back, "--job.dry_run")
    assert second.returncode == 0, second.stderr
    assert second.stdout == first.stdout


def leaf_flags(cls: type, prefix: str = "--") -> list[str]:
    """The CLI flag of every leaf field of the dataclass tree `cls`."""
    flags = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.type):
            flags += leaf_flags(f.type, f"{prefix}{f.name}.")
        else:
            flags.append(f"{prefix}{f.name}")
    return flags


def test_help_lists_every_field_with_its_docstring():
    result = run_train("--help", env={"COLUMNS": "200"})
    assert result.returncode == 0
    # task.sources is a table of sections: its flags are those of the sources a TOML names
    # (tests/unit/test_mixture.py).
    flags = [f for f in leaf_flags(JobConfig) if f != "--task.sources"]
    assert len(flags) > 40
    for flag in flags:
        assert f"{flag} " in result.stdout, flag
    # Docstrings from every depth of the tree, as tyro prints them.
    help_text = " ".join(result.stdout.split())
    assert "Global batch-invariant mode" in help_text
    assert "Samples per prompt (the GRPO group size)." in help_text
    assert "Keep this many newest checkpoints; 0 keeps all." in help_text
