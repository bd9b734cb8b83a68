"""Reward functions, user reward functions given as `module:function`, and the error policy.

.venv/bin/python -m pytest tests/unit/test_tasks.py
"""

import functools
import re
import signal
import threading
from collections.abc import Callable
from contextlib import contextmanager

from torchtitan_rl import console
from torchtitan_rl.config.manager import import_spec
from torchtitan_rl.errors import StopRun
from torchtitan_rl.tasks.base import Task
from torchtitan_rl.types import Prompt

# fn(prompt, completion, answer) -> reward
RewardFn = Callable[[str, str, str], float]


_INTEGER = re.compile(r"-?\d+")


def math_reward(prompt: str, completion: str, answer: str) -> float:
    """1.0 if the completion's final answer (\\boxed{...} or the last number) equals `answer`."""
    if _INTEGER.fullmatch(completion.strip()) and _INTEGER.fullmatch(answer.strip()):
        # Both plain integers (most arithmetic answers): the same verdict without math-verify's
        # sympy parse, measured at a quarter of an arithmetic demo step.
        return float(int(completion) == int(answer))
    mv = _math_verify()
    # math-verify's own SIGALRM timeouts would cancel the Scorer's (task.reward_timeout_s).
    gold = mv.parse(answer, parsing_timeout=None)
    guess = mv.parse(completion, parsing_timeout=None)
    return 1.0 if mv.verify(gold, guess, timeout_seconds=None) else 0.0


@functools.cache
def _math_verify():
    # Imported on first use (it pulls in sympy), then once: a `from ... import` per call was
    # measured at a quarter of the scoring time.
    import math_verify

    return math_verify


def load_reward_fn(spec: str) -> RewardFn:
    """The function named by 'package.module:function'; a ConfigError if it does not import."""
    return import_spec(spec, "task.reward_fn", "function")


class RewardError(StopRun):
    """A reward function raised or timed out and task.reward_on_error = "fail"."""


class RewardTimeout(Exception):
    """One reward call ran past task.reward_timeout_s."""


@contextmanager
def time_limit(seconds: float):
    """Raise RewardTimeout in the block after `seconds` (0: no limit). SIGALRM interrupts
    Python code, so the limit applies in the main thread only; elsewhere there is none."""
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise RewardTimeout(f"took longer than task.reward_timeout_s = {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class Scorer:
    """Scores completions with the task's reward (or `reward_fn`), applying the error policy:
    a reward function that raises or runs past `timeout_s` is counted and logged, and the
    sample gets 0 ("zero") or the run stops ("fail")."""

    def __init__(
        self, task: Task, reward_fn: RewardFn | None, on_error: str, timeout_s: float = 0.0
    ):
        self.task, self.reward_fn, self.on_error = task, reward_fn, on_error
        self.timeout_s = timeout_s
        self.errors = 0

    def __call__(self, prompt: Prompt, completion: str) -> float:
        try:
            with time_limit(self.timeout_s):
                if self.reward_fn is not None:
                    return float(self.reward_fn(prompt.text, completion, prompt.answer))
                return float(self.task.reward(prompt, completion))
        except Exception as e:  # user code: any exception is the reward function's failure
            what = str(e) if isinstance(e, RewardTimeout) else f"raised {e!r}"
            return self.failed(f"the reward function {what}", prompt, e)

    def failed(self, what: str, prompt: Prompt, cause: BaseException | None = None) -> float:
        """The reward of a sample whose scoring failed (`what` did): 0, counted and logged
        once ("zero"), or a RewardError that stops the run ("fail")."""
        if self.on_error == "fail":
            raise RewardError(f"{what} on prompt {prompt.text!r}") from cause
        self.errors += 1
        if self.errors == 1:
            console.warn(f"warning: {what}; such samples get reward 0")
        return 0.0
