"""Reward functions, user reward functions given as `module:function`, and the error policy.

.venv/bin/python -m pytest tests/unit/test_tasks.py
"""

import asyncio
import functools
import inspect
import math
import re
import signal
import threading
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

from torchtitan_rl import console
from torchtitan_rl.config import ConfigError
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


def exact_match_reward(prompt: str, completion: str, answer: str) -> float:
    """1.0 if the completion, without surrounding whitespace, is `answer`: for answers that are
    words ("red", "left"), which math_reward scores 0."""
    return float(completion.strip() == answer.strip())


@functools.cache
def _math_verify():
    # Imported on first use (it pulls in sympy), then once: a `from ... import` per call was
    # measured at a quarter of the scoring time.
    import math_verify

    return math_verify


def load_reward_fn(spec: str, field: str = "task.reward_fn") -> RewardFn:
    """The function named by 'package.module:function'; a ConfigError if it does not import."""
    return import_spec(spec, field, "function")


def batched(fn):
    """Declare a reward function batched: `fn(prompts, completions, answers) -> list[float]`,
    called once with a step's completions (this rank's), e.g. to send them to a judge model in
    one request. May be `async`, as may a per-sample function."""
    fn.batched = True
    return fn


@dataclass(frozen=True, slots=True)
class Reward:
    """One reward function of a run, and its weight in the sum that is the reward."""

    name: str
    """Its function's name: metrics log its mean as reward/<name>."""
    fn: Callable
    weight: float = 1.0

    @property
    def batched(self) -> bool:
        return bool(getattr(self.fn, "batched", False))

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.fn)


def load_rewards(
    reward_fn: str | None, rewards: dict[str, float], at: str = "task"
) -> list[Reward]:
    """The reward functions of `at`.reward_fn (one, weight 1) or `at`.rewards (spec ->
    weight), imported; [] for the task's own reward. `at`: task or task.sources.NAME."""
    specs = {reward_fn: 1.0} if reward_fn else rewards
    loaded = [
        Reward(spec.split(":")[1], load_reward_fn(spec, _field(reward_fn, spec, at)), weight)
        for spec, weight in specs.items()
    ]
    names = [r.name for r in loaded]
    for name in names:
        if name in ("mean", "std", "errors"):
            raise ConfigError(
                f"{at}.rewards: a function called {name!r} would log as reward/{name}, which "
                "the run's own reward figures use; rename it"
            )
        if names.count(name) > 1:
            raise ConfigError(
                f"{at}.rewards names two functions called {name!r}: their metrics would both "
                f"be reward/{name}; rename one"
            )
    return loaded


def _field(reward_fn: str | None, spec: str, at: str) -> str:
    return f"{at}.reward_fn" if reward_fn else f"{at}.rewards[{spec!r}]"


class RewardError(StopRun):
    """A reward function raised or timed out and task.reward_on_error = "fail"."""


class RewardTimeout(Exception):
    """One reward call ran past task.reward_timeout_s."""


class WrongReturn(Exception):
    """A reward function returned something other than a number per sample."""


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
    """Scores completions with the task's reward or their source's reward functions (their
    weighted sum), applying the error policy: a reward function that raises, runs past
    `timeout_s` or returns something that is not one number per sample is counted and logged,
    and the sample gets 0 ("zero") or the run stops ("fail")."""

    def __init__(
        self,
        task: Task,
        rewards: dict[str, list[Reward]],
        on_error: str,
        timeout_s: float = 0.0,
        log_each: bool = False,
    ):
        """`rewards[source]`: the reward functions of the prompts of that source (Prompt.source;
        "" in a run of one task); a source without any is scored by `task.reward`.
        `log_each`: give each reward function's values too (reward/<name>: task.rewards)."""
        self.task, self.rewards, self.on_error = task, rewards, on_error
        self.timeout_s, self.log_each = timeout_s, log_each
        self.errors = 0

    @property
    def names(self) -> list[str]:
        """The reward functions whose values `score` gives one by one."""
        if not self.log_each:
            return []
        return list(dict.fromkeys(r.name for rewards in self.rewards.values() for r in rewards))

    async def score(
        self, prompts: list[Prompt], completions: list[str]
    ) -> tuple[list[float], dict[str, list[float]]]:
        """The reward of each completion of `prompts[i]`, and each reward function's own
        values by name (`names`; NaN for a sample whose source does not use it). A source's
        batched functions take one call; async ones run concurrently, each call within
        `timeout_s`."""
        by_source: dict[str, list[int]] = {}
        for i, prompt in enumerate(prompts):
            by_source.setdefault(prompt.source, []).append(i)
        total = [0.0] * len(prompts)
        parts = {name: [math.nan] * len(prompts) for name in self.names}
        for source, index in by_source.items():
            mine = [prompts[i] for i in index], [completions[i] for i in index]
            values, own = await self._score_source(self.rewards.get(source, []), *mine)
            for j, i in enumerate(index):
                total[i] = values[j]
            for name in parts.keys() & own.keys():
                for j, i in enumerate(index):
                    parts[name][i] = own[name][j]
        return total, parts

    async def _score_source(
        self, rewards: list[Reward], prompts: list[Prompt], completions: list[str]
    ) -> tuple[list[float], dict[str, list[float]]]:
        """The rewards of one source's completions, and each of its functions' values."""
        if not rewards:
            return [self._task_reward(p, c) for p, c in zip(prompts, completions, strict=True)], {}
        parts = {}
        for reward in rewards:
            if reward.batched:
                parts[reward.name] = await self._batch(reward, prompts, completions)
            elif reward.is_async:
                pairs = zip(prompts, completions, strict=True)
                calls = [self._one_async(reward, p, c) for p, c in pairs]
                parts[reward.name] = list(await asyncio.gather(*calls))
            else:
                calls = zip(prompts, completions, strict=True)
                parts[reward.name] = [self._one(reward, p, c) for p, c in calls]
        total = [sum(r.weight * parts[r.name][i] for r in rewards) for i in range(len(prompts))]
        return total, parts

    def _what(self, who: str, e: Exception) -> str:
        if isinstance(e, RewardTimeout | TimeoutError):
            return f"{who} took longer than task.reward_timeout_s = {self.timeout_s:g} s"
        if isinstance(e, WrongReturn):
            return f"{who} {e}"
        return f"{who} raised {e!r}"

    def _task_reward(self, prompt: Prompt, completion: str) -> float:
        try:
            with time_limit(self.timeout_s):
                return _number(self.task.reward(prompt, completion))
        except Exception as e:  # a task's reward on a completion: counted as the user's are
            return self.failed(self._what("the task's reward", e), prompt, e)

    def _one(self, reward: Reward, prompt: Prompt, completion: str) -> float:
        try:
            with time_limit(self.timeout_s):
                return _number(reward.fn(prompt.text, completion, prompt.answer))
        except Exception as e:  # user code: any exception is the reward function's failure
            return self.failed(self._what(f"the reward function {reward.name}", e), prompt, e)

    async def _one_async(self, reward: Reward, prompt: Prompt, completion: str) -> float:
        try:
            async with asyncio.timeout(self.timeout_s or None):
                return _number(await reward.fn(prompt.text, completion, prompt.answer))
        except Exception as e:  # user code: any exception is the reward function's failure
            return self.failed(self._what(f"the reward function {reward.name}", e), prompt, e)

    async def _batch(
        self, reward: Reward, prompts: list[Prompt], completions: list[str]
    ) -> list[float]:
        args = ([p.text for p in prompts], completions, [p.answer for p in prompts])
        try:
            if reward.is_async:
                async with asyncio.timeout(self.timeout_s or None):
                    values = await reward.fn(*args)
            else:
                with time_limit(self.timeout_s):
                    values = reward.fn(*args)
            values = list(values)
            if len(values) != len(prompts):
                raise WrongReturn(f"returned {len(values)} values for {len(prompts)} completions")
            return [_number(v) for v in values]
        except Exception as e:  # user code: the whole batch failed
            what = self._what(f"the batched reward function {reward.name}", e)
            return [self.failed(what, p, e) for p in prompts]

    def failed(self, what: str, prompt: Prompt, cause: BaseException | None = None) -> float:
        """The reward of a sample whose scoring failed (`what` did): 0, counted and logged
        once ("zero"), or a RewardError that stops the run ("fail")."""
        if self.on_error == "fail":
            raise RewardError(f"{what} on prompt {prompt.text!r}") from cause
        self.errors += 1
        if self.errors == 1:
            console.warn(f"warning: {what}; such samples get reward 0")
        return 0.0


def _number(value) -> float:
    """A reward as a float; anything but a number (a string, a list, None) is the reward
    function's error."""
    if isinstance(value, str | bytes | bool) or not hasattr(value, "__float__"):
        raise WrongReturn(f"returned {value!r:.60}, not a number")
    return float(value)
