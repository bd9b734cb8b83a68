"""Evaluation, in process: the unbiased pass@k, eval metrics from summed totals, eval config
checks. A run that evaluates, and scripts/eval.py: tests/integration/test_eval.py.

    .venv/bin/python -m pytest tests/unit/test_eval.py
"""

import math

import pytest

from torchtitan_rl.config import ConfigError, parse_args
from torchtitan_rl.evaluation import pass_at_k, pass_ks
from torchtitan_rl.types import EvalShard

TINY = "assets/tiny_qwen3"


def test_pass_at_k_matches_the_unbiased_formula_by_hand():
    # n = 5 samples, c = 2 correct: pass@1 = 2/5; pass@2 = 1 - C(3,2)/C(5,2) = 1 - 3/10;
    # pass@4 = 1 - C(3,4)/C(5,4) = 1 (fewer than 4 wrong samples).
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    assert pass_at_k(5, 2, 4) == 1.0
    assert pass_at_k(5, 0, 4) == 0.0
    # n = 8, c = 3, k = 4: 1 - C(5,4)/C(8,4) = 1 - 5/70.
    assert pass_at_k(8, 3, 4) == pytest.approx(1 - 5 / 70)
    assert pass_ks(8) == [1, 2, 4, 8] and pass_ks(6) == [1, 2, 4] and pass_ks(1) == [1]
    assert math.isclose(pass_at_k(8, 3, 1), 3 / 8)


def test_eval_metrics_from_merged_shards():
    a = EvalShard(
        3,
        {"prompts": 2, "samples": 8, "correct": 3, "reward": 3.5, "tokens": 16, "truncated": 1}
        | {"pass@1": 0.75, "pass@4": 1.0, "tool_calls": 6},
        samples=[{"prompt": "a"}],
        seconds=1.0,
    )
    b = EvalShard(
        3,
        {"prompts": 1, "samples": 4, "correct": 0, "reward": 0.0, "tokens": 4, "truncated": 0}
        | {"pass@1": 0.0, "pass@4": 0.0, "tool_calls": 0},
        samples=[{"prompt": "b"}],
        seconds=2.0,
    )
    metrics = EvalShard.merge([a, b]).metrics()
    assert metrics["eval/accuracy"] == 3 / 12 and metrics["eval/reward"] == 3.5 / 12
    assert metrics["eval/pass@1"] == 0.25 and metrics["eval/pass@4"] == pytest.approx(1 / 3)
    assert metrics["eval/response_length"] == 20 / 12 and metrics["eval/prompts"] == 3
    assert metrics["eval/policy_version"] == 3 and metrics["time/eval_s"] == 2.0
    assert metrics["eval/tool_calls"] == 6 / 12
    # The second rank of a tensor-parallel engine evaluated the same prompts as the first: it
    # adds nothing, and keeps its time.
    again = EvalShard.merge([a, a.counted_elsewhere(), b]).metrics()
    assert again == metrics | {"time/eval_s": 2.0}
    assert a.counted_elsewhere().samples == [] and a.counted_elsewhere().seconds == 1.0


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--eval.n", "4"],
            "eval.n = 4 with eval.temperature = 0: greedy samples are all the same",
        ),
        (["--eval.dataset_path", "/no/such"], "eval.dataset_path = '/no/such': no such file"),
        (["--eval.dataset_path", "data/arith"], "eval.dataset_path is set but task.name = 'echo"),
        (["--eval.max_tokens", "0"], "eval.max_tokens = 0: must be >= 1"),
    ],
)
def test_bad_eval_settings_are_refused(flags, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(["--model.hf_checkpoint", TINY, *flags])
