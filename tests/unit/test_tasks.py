"""Tasks and rewards: dataset prompts, math-verify, user reward functions, the error policy.

.venv/bin/python -m pytest tests/unit/test_tasks.py
"""

import json

import pytest
from helpers.launch import HELPERS, REPO

from torchtitan_rl.config import ConfigError, parse_args
from torchtitan_rl.episodes import open_task
from torchtitan_rl.tasks.dataset import DatasetKeys, DatasetTask, read_rows
from torchtitan_rl.tasks.rewards import (
    load_reward_fn,
    math_reward,
)
from torchtitan_rl.tasks.toy import ReverseDigitsTask


@pytest.fixture
def dataset(tmp_path) -> str:
    path = tmp_path / "math.jsonl"
    rows = [{"prompt": f"what is {i}+1?", "answer": str(i + 1)} for i in range(5)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_a_dataset_cycles_every_row_once_per_epoch_in_seeded_order(dataset):
    task = DatasetTask(dataset, DatasetKeys(), seed=3)
    first_epoch = [p.text for p in task.prompts(1, 5)]
    assert sorted(first_epoch) == sorted(f"what is {i}+1?" for i in range(5))
    assert task.prompts(2, 5) != task.prompts(1, 5)  # a new order in the next epoch
    assert [
        p.text for p in DatasetTask(dataset, DatasetKeys(), seed=3).prompts(1, 5)
    ] == first_epoch


@pytest.mark.parametrize(
    "completion, reward",
    [
        ("so it is \\boxed{3}", 1.0),
        ("2 + 1 = 3", 1.0),
        ("\\boxed{4}", 0.0),
        ("no idea", 0.0),
        # Plain integers take the fast path; the verdict is math-verify's.
        ("3", 1.0),
        (" 03 ", 1.0),
        ("4", 0.0),
        ("-3", 0.0),
    ],
)
def test_math_reward_reads_boxed_or_last_number(completion, reward):
    assert math_reward("what is 2+1?", completion, "3") == reward


@pytest.mark.parametrize(
    "content, message",
    [
        (b'{"prompt": "a", "answer": "1"}\n{"prompt": "b",\n', ":2: not a JSON object"),
        (b'{"answer": "1"}\n', r':1: needs a string "prompt" \(task.prompt_key\)'),
        (b'{"prompt": "  ", "answer": "1"}\n', ":1: the prompt is empty"),
        (b'{"prompt": "a"}\n', r':1: needs an "answer" \(task.answer_key\)'),
        (b"\n\n", "has no rows"),
        (b'{"prompt": "caf\xe9"}\n', "is not UTF-8 text"),
    ],
)
def test_bad_dataset_files_name_the_line(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=message):
        read_rows(str(path), DatasetKeys())


def test_user_reward_functions_load_or_say_why(monkeypatch):
    monkeypatch.syspath_prepend(HELPERS)
    fn = load_reward_fn("user_rewards:starts_with_answer")
    assert fn("p", "42!", "42") == 1.0
    with pytest.raises(ConfigError, match="cannot import 'no_such_module'"):
        load_reward_fn("no_such_module:f")
    with pytest.raises(ConfigError, match="has no function 'missing'"):
        load_reward_fn("user_rewards:missing")


def test_task_config_errors(dataset):
    tiny = str(REPO / "assets" / "tiny_qwen3")
    with pytest.raises(ConfigError, match="task.name = 'dataset' needs task.dataset_path"):
        parse_args(["--model.hf_checkpoint", tiny, "--task.name", "dataset"])
    with pytest.raises(ConfigError, match="task.dataset_path is set but task.name = 'echo_dig"):
        parse_args(["--model.hf_checkpoint", tiny, "--task.dataset_path", dataset])
    config = parse_args(["--model.hf_checkpoint", tiny, "--task.reward_fn", "nope:f"])
    with pytest.raises(ConfigError, match="task.reward_fn = 'nope:f': cannot import"):
        open_task(config)
    config = parse_args(
        ["--model.hf_checkpoint", tiny, "--task.name", "dataset", "--task.dataset_path", dataset]
    )
    assert open_task(config).task.every_prompt()[0].text == "what is 0+1?"


def test_reverse_task():
    prompt = ReverseDigitsTask(num_digits=3, seed=0).prompts(1, 1)[0]
    digits = prompt.text.split()[1].rstrip(":")
    assert prompt.text.startswith("reverse ") and prompt.answer == digits[::-1]
