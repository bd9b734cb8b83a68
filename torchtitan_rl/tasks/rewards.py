"""Reward functions, user reward functions given as `module:function`, and the error policy.

.venv/bin/python -m pytest tests/test_tasks.py
"""

import importlib
import logging
from collections.abc import Callable

from torchtitan_rl.config.job_config import ConfigError
from torchtitan_rl.tasks.base import Prompt, Task

logger = logging.getLogger(__name__)

# fn(prompt, completion, answer) -> reward
RewardFn = Callable[[str, str, str], float]


def math_reward(prompt: str, completion: str, answer: str) -> float:
    """1.0 if the completion's final answer (\\boxed{...} or the last number) equals `answer`."""
    from math_verify import parse, verify

    return 1.0 if verify(parse(answer), parse(completion)) else 0.0


def load_reward_fn(spec: str) -> RewardFn:
    """The function named by 'package.module:function'; a ConfigError if it does not import."""
    module_name, _, function_name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # the user's module may fail in any way while importing
        raise ConfigError(
            f"task.reward_fn = {spec!r}: cannot import {module_name!r} ({e})"
        ) from None
    fn = getattr(module, function_name, None)
    if not callable(fn):
        raise ConfigError(
            f"task.reward_fn = {spec!r}: {module_name} has no function {function_name!r}"
        )
    return fn


class RewardError(RuntimeError):
    """A reward function raised and task.reward_on_error = "fail"."""


class Scorer:
    """Scores completions with the task's reward (or `reward_fn`), applying the error policy:
    a reward function that raises is counted and logged, and the sample gets 0 ("zero") or the
    run stops ("fail")."""

    def __init__(self, task: Task, reward_fn: RewardFn | None, on_error: str):
        self.task, self.reward_fn, self.on_error = task, reward_fn, on_error
        self.errors = 0

    def __call__(self, prompt: Prompt, completion: str) -> float:
        try:
            if self.reward_fn is not None:
                return float(self.reward_fn(prompt.text, completion, prompt.answer))
            return float(self.task.reward(prompt, completion))
        except Exception as e:  # user code: any exception is the reward function's failure
            if self.on_error == "fail":
                message = f"the reward function raised on prompt {prompt.text!r}: {e!r}"
                raise RewardError(message) from e
            self.errors += 1
            if self.errors == 1:
                logger.warning("reward function raised (%r); such samples get reward 0", e)
            return 0.0
