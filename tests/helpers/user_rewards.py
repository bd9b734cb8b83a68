"""Reward functions that tests name as task.reward_fn (with tests/helpers on PYTHONPATH)."""

import time

_calls = 0


def starts_with_answer(prompt: str, completion: str, answer: str) -> float:
    return 1.0 if completion.startswith(answer) else 0.0


def raises_on_odd(prompt: str, completion: str, answer: str) -> float:
    if int(answer) % 2:
        raise ValueError("odd answers are not scored")
    return 1.0 if completion.startswith(answer) else 0.0


def hangs_on_odd(prompt: str, completion: str, answer: str) -> float:
    if int(answer) % 2:
        time.sleep(60)
    return 1.0 if completion.startswith(answer) else 0.0


def nan_from_step_3(prompt: str, completion: str, answer: str) -> float:
    """The echo reward for the demo config's first 2 steps (128 calls per rank and step on 2
    ranks), then NaN."""
    global _calls
    _calls += 1
    return float("nan") if _calls > 256 else (1.0 if completion.startswith(answer) else 0.0)
