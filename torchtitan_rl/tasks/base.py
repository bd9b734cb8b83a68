"""The task protocol: where a step's prompts come from, and how a completion is rewarded.

.venv/bin/python -m pytest tests/unit/test_tasks.py
"""

from typing import Protocol

from torchtitan_rl.types import Prompt


class Task(Protocol):
    def prompts(self, step: int, count: int, round: int = 0) -> list[Prompt]:
        """The `count` prompts of `step` (the same on every rank; each takes its shard).
        `round` > 0: further, different prompts for the step (dynamic sampling's rounds)."""
        ...

    def rows(self, start: int, count: int, round: int = 0) -> list[Prompt]:
        """Positions start .. start + count of the task's endless stream of prompts (a
        mixture's source is read from a cursor, tasks.mixture)."""
        ...

    def reward(self, prompt: Prompt, completion: str) -> float:
        """Reward of `completion` (decoded text, without the stop token) for `prompt`."""
        ...

    def every_prompt(self) -> list[Prompt]:
        """Prompts that cover every prompt length the task can produce (checked at start)."""
        ...
