"""Tasks and rewards: dataset prompts, math-verify, user reward functions, the error policy.

.venv/bin/python -m pytest tests/unit/test_tasks.py
"""

import asyncio
import json
import time

import pytest
from helpers.launch import HELPERS, REPO

from torchtitan_rl.config import ConfigError, parse_args
from torchtitan_rl.episodes import open_task
from torchtitan_rl.tasks.dataset import DatasetKeys, DatasetTask, read_rows
from torchtitan_rl.tasks.rewards import (
    RewardError,
    Scorer,
    load_reward_fn,
    load_rewards,
    math_reward,
)
from torchtitan_rl.tasks.toy import EchoDigitsTask, ReverseDigitsTask
from torchtitan_rl.types import Prompt


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


def test_async_batched_and_weighted_reward_functions_sum_and_log_each(monkeypatch):
    """Three functions of task.rewards on 6 completions: an async one (6 calls of 0.2 s,
    awaited together), a plain one weighted 0.5, a batched async one (one call) weighted 2."""
    monkeypatch.syspath_prepend(HELPERS)
    import user_rewards

    rewards = load_rewards(
        None,
        {
            "user_rewards:async_starts_with_answer": 1.0,
            "user_rewards:shorter_is_better": 0.5,
            "user_rewards:async_batch_starts_with_answer": 2.0,
        },
    )
    assert [(r.name, r.batched, r.is_async) for r in rewards] == [
        ("async_starts_with_answer", False, True),
        ("shorter_is_better", False, False),
        ("async_batch_starts_with_answer", True, True),
    ]
    scorer = Scorer(EchoDigitsTask(), {"": rewards}, "zero", timeout_s=5.0, log_each=True)
    prompts = [Prompt(text=f"echo {d}:", answer=str(d)) for d in range(6)]
    completions = ["0", "1x", "9", "3", "44", "x"]
    user_rewards.BATCH_CALLS.clear()
    start = time.monotonic()
    total, parts = asyncio.run(scorer.score(prompts, completions))
    assert time.monotonic() - start < 0.8  # 6 x 0.2 s one after another would be 1.2 s
    assert user_rewards.BATCH_CALLS == [6]
    right = [1.0, 1.0, 0.0, 1.0, 1.0, 0.0]
    short = [-len(c) / 10 for c in completions]
    assert parts == {
        "async_starts_with_answer": right,
        "shorter_is_better": short,
        "async_batch_starts_with_answer": right,
    }
    assert total == pytest.approx([3 * r + 0.5 * s for r, s in zip(right, short, strict=True)])
    assert scorer.errors == 0


def test_a_reward_function_that_returns_the_wrong_thing_scores_as_reward_on_error(monkeypatch):
    monkeypatch.syspath_prepend(HELPERS)
    prompts = [Prompt(text=f"echo {d}:", answer=str(d)) for d in range(3)]
    for spec, message in (
        ("user_rewards:batch_drops_one", "batch_drops_one returned 2 values for 3 completions"),
        ("user_rewards:not_a_number", "not_a_number returned '1.0', not a number"),
    ):
        rewards = load_rewards(None, {spec: 1.0, "user_rewards:starts_with_answer": 1.0})
        zero = Scorer(EchoDigitsTask(), {"": rewards}, "zero", log_each=True)
        total, parts = asyncio.run(zero.score(prompts, ["0", "1", "2"]))
        assert total == [1.0, 1.0, 1.0] and zero.errors == 3  # the wrong one scores 0
        with pytest.raises(RewardError, match=message):
            asyncio.run(
                Scorer(EchoDigitsTask(), {"": rewards}, "fail").score(prompts, ["0", "1", "2"])
            )


def test_reward_tables_that_cannot_work_are_refused(monkeypatch):
    monkeypatch.syspath_prepend(HELPERS)
    tiny = str(REPO / "assets" / "tiny_qwen3")
    base = ["--model.hf_checkpoint", tiny]
    for flags, message in (
        (
            ["--task.reward_fn", "user_rewards:starts_with_answer", "--task.rewards", "a:f", "1"],
            "task.reward_fn = 'user_rewards:starts_with_answer' and task.rewards are both set",
        ),
        (["--task.rewards", "a:f", "0"], r"task.rewards\['a:f'\] = 0.0: a weight must be"),
        (["--task.rewards", "a.f", "1"], r"task.rewards\['a.f'\]: write the function as"),
    ):
        with pytest.raises(ConfigError, match=message):
            parse_args(base + flags)
    with pytest.raises(ConfigError, match=r"task.rewards\['nope:f'\] = 'nope:f': cannot import"):
        load_rewards(None, {"nope:f": 1.0})
    with pytest.raises(ConfigError, match="would log as reward/mean"):
        load_rewards(None, {"statistics:mean": 1.0})
    with pytest.raises(ConfigError, match="two functions called 'sqrt'"):
        load_rewards(None, {"math:sqrt": 1.0, "cmath:sqrt": 1.0})


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
