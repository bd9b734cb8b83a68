"""Bad input that a launched run must refuse: exit code 2 and one line naming the field or
file and the fix, before any model or engine is built. The config cases in process:
tests/unit/test_bad_inputs.py.

    .venv/bin/python -m pytest tests/integration/test_bad_inputs.py
"""

import json

import pytest
from helpers.launch import DEBUG_TOML, run_train

# run_configs name assets/ relative to the repo root, as the README's commands do.
pytestmark = pytest.mark.usefixtures("repo_cwd")


def test_unwritable_dump_folder_refuses_to_start(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    result = run_train("--job.config_file", DEBUG_TOML, "--job.dump_folder", str(blocker / "run"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: job.dump_folder = '{blocker / 'run'}' is not writable (Not a directory): "
        "point it at a folder this user can write"
    ]


def test_dump_folder_with_a_checkpoint_of_another_model(tmp_path):
    step = tmp_path / "checkpoints" / "step-4"
    step.mkdir(parents=True)
    (step / "__0_0.distcp").write_bytes(b"x" * 10)
    facts = {"model": {"name": "llama3", "flavor": "tiny"}, "seed": 0, "prompts_per_step": 32,
             "world_size": 1, "hf_checkpoint": None, "tokenizer_dir": None}  # fmt: skip
    manifest = {"step": 4, "facts": facts, "files": {"__0_0.distcp": 10}}
    (step / "manifest.json").write_text(json.dumps(manifest))
    result = run_train(
        "--job.config_file", DEBUG_TOML, "--job.dump_folder", str(tmp_path), "--checkpoint.enable"
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: {step} holds a checkpoint of model llama3/tiny, but model.name/model.flavor "
        "are qwen3/tiny: use another job.dump_folder, or the model the checkpoint was saved from"
    )


def test_a_prompt_over_max_prompt_len_is_found_when_the_dataset_is_read(tmp_path):
    """Before any model or engine is built, naming file:line (not mid-run, at the step that
    draws the row)."""
    data = tmp_path / "data.jsonl"
    rows = [{"prompt": "1+1=", "answer": "2"}] * 40 + [{"prompt": "1+" * 30 + "1=", "answer": "31"}]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    result = run_train(
        *("--job.config_file", DEBUG_TOML, "--job.dump_folder", str(tmp_path / "run")),
        *("--task.name", "dataset", "--task.dataset_path", str(data)),
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: {data}:41: prompt '1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+' has 81 tokens "
        "after the chat template, more than training.max_prompt_len = 32: raise it or shorten "
        "the prompt"
    )
    assert "generator" not in result.stderr.lower()  # refused before the engine was built
