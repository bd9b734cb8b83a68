"""Tasks and rewards: dataset prompts, math-verify, user reward functions, the error policy.

.venv/bin/python -m pytest tests/test_tasks.py
"""

import json
import subprocess

import pytest
from helpers.launch import HELPERS, run_train


@pytest.fixture
def dataset(tmp_path) -> str:
    path = tmp_path / "math.jsonl"
    rows = [{"prompt": f"what is {i}+1?", "answer": str(i + 1)} for i in range(5)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def train(tmp_path, *flags: str) -> subprocess.CompletedProcess:
    return run_train(
        "--job.config_file",
        "run_configs/debug_cpu.toml",
        "--job.dump_folder",
        str(tmp_path / "run"),
        *flags,
        env={"PYTHONPATH": HELPERS},
    )


def test_a_nan_reward_stops_the_run_naming_the_step(tmp_path):
    result = train(
        tmp_path, "--training.steps", "3", "--task.reward_fn", "user_rewards:not_a_number"
    )
    assert result.returncode == 1
    assert "error: step 1: a reward is not finite" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_run_on_a_dataset_with_a_user_reward_that_raises(tmp_path):
    rows = [{"prompt": f"echo {d}:", "answer": str(d)} for d in range(10)]
    (tmp_path / "echo.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    result = train(
        tmp_path,
        "--training.steps",
        "2",
        "--task.name",
        "dataset",
        "--task.dataset_path",
        str(tmp_path / "echo.jsonl"),
        "--task.reward_fn",
        "user_rewards:raises_on_odd",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in metrics]
    # Every step draws odd answers, whose reward raises: counted (cumulatively), scored 0.
    assert 0 < rows[0]["reward/errors"] < rows[1]["reward/errors"]
    assert all(0.0 <= r["reward/mean"] <= 0.5 for r in rows)
