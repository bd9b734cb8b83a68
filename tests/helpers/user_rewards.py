"""Reward functions that tests name as task.reward_fn (with tests/helpers on PYTHONPATH)."""


def starts_with_answer(prompt: str, completion: str, answer: str) -> float:
    return 1.0 if completion.startswith(answer) else 0.0


def raises_on_odd(prompt: str, completion: str, answer: str) -> float:
    if int(answer) % 2:
        raise ValueError("odd answers are not scored")
    return 1.0 if completion.startswith(answer) else 0.0


def not_a_number(prompt: str, completion: str, answer: str) -> float:
    return float("nan")
