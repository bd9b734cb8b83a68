"""Faults, in process: non-finite logprobs named, reward functions that raise or hang. In
real runs: tests/integration/test_faults.py and test_resume.py; a NaN/inf loss or gradient:
test_model.py (test_non_finite_step_stops_without_touching_weights).

    .venv/bin/python -m pytest tests/unit/test_faults.py
"""

import asyncio
import time

import pytest
import torch
from helpers.launch import HELPERS

from torchtitan_rl.tasks.rewards import RewardError, Scorer, load_rewards, math_reward, time_limit
from torchtitan_rl.tasks.toy import EchoDigitsTask
from torchtitan_rl.trainer.policy_trainer import NonFiniteError, check_finite
from torchtitan_rl.types import Prompt


def test_a_non_finite_logprob_is_named():
    logprobs = torch.zeros(2, 5)
    mask = torch.zeros(2, 5, dtype=torch.bool)
    mask[:, 2:] = True
    logprobs[0, 1] = float("nan")  # not a sampled token: ignored
    check_finite(7, "generator", logprobs, mask)
    logprobs[1, 3] = float("-inf")
    with pytest.raises(
        NonFiniteError, match="step 7: the generator logprob of sequence 1, token 3 is -inf"
    ):
        check_finite(7, "generator", logprobs, mask)


def score(scorer: Scorer, prompts: list[Prompt], completions: list[str]) -> list[float]:
    return asyncio.run(scorer.score(prompts, completions))[0]


def test_reward_errors_count_as_zero_or_stop_the_run(monkeypatch):
    monkeypatch.syspath_prepend(HELPERS)
    rewards = load_rewards("user_rewards:raises_on_odd", {})
    task = EchoDigitsTask()
    odd, even = Prompt(text="echo 3:", answer="3"), Prompt(text="echo 4:", answer="4")
    zero = Scorer(task, {"": rewards}, on_error="zero")
    assert score(zero, [odd, even, odd], ["3", "4", "3"]) == [0.0, 1.0, 0.0]
    assert zero.errors == 2
    with pytest.raises(RewardError, match=r"raised ValueError\(.*\) on prompt 'echo 3:'"):
        score(Scorer(task, {"": rewards}, on_error="fail"), [odd], ["3"])


def test_a_hanging_reward_times_out_and_counts_or_stops(monkeypatch):
    monkeypatch.syspath_prepend(HELPERS)
    rewards = load_rewards("user_rewards:hangs_on_odd", {})
    task = EchoDigitsTask()
    odd, even = Prompt(text="echo 3:", answer="3"), Prompt(text="echo 4:", answer="4")
    zero = Scorer(task, {"": rewards}, on_error="zero", timeout_s=0.2)
    start = time.monotonic()
    assert score(zero, [odd, even], ["3", "4"]) == [0.0, 1.0]
    assert zero.errors == 1 and time.monotonic() - start < 5
    with pytest.raises(RewardError, match=r"took longer than task.reward_timeout_s = 0.2 s on"):
        score(Scorer(task, {"": rewards}, on_error="fail", timeout_s=0.2), [odd], ["3"])
    # The built-in math reward runs under the same limit without math-verify's own alarms.
    with time_limit(5.0):
        assert math_reward("2 + 2?", "so \\boxed{4}", "4") == 1.0
