"""The task protocol and the registry the `task` config section chooses from.

.venv/bin/python -m pytest tests/test_tasks.py
"""

from dataclasses import dataclass
from typing import Protocol

from torchtitan_rl.config.job_config import ConfigError, TaskSection


@dataclass(frozen=True, slots=True)
class Prompt:
    text: str
    answer: str
    """What a reward function compares the completion with."""
    source: str = ""
    """Where the prompt comes from, for errors: "file:line" for dataset rows."""


class Task(Protocol):
    def prompts(self, step: int, count: int, round: int = 0) -> list[Prompt]:
        """The `count` prompts of `step` (the same on every rank; each takes its shard).
        `round` > 0: further, different prompts for the step (dynamic sampling's rounds)."""
        ...

    def reward(self, prompt: Prompt, completion: str) -> float:
        """Reward of `completion` (decoded text, without the stop token) for `prompt`."""
        ...

    def every_prompt(self) -> list[Prompt]:
        """Prompts that cover every prompt length the task can produce (checked at start)."""
        ...


def build_task(task: TaskSection, seed: int) -> Task:
    from torchtitan_rl.tasks.jsonl import JsonlTask
    from torchtitan_rl.tasks.toy import EchoDigitsTask, ReverseDigitsTask

    if task.name == "echo_digits":
        return EchoDigitsTask(num_digits=task.num_digits, seed=seed)
    if task.name == "reverse_digits":
        return ReverseDigitsTask(num_digits=task.num_digits, seed=seed)
    if task.name == "jsonl":
        return JsonlTask(task.dataset_path, seed=seed)
    raise ConfigError(
        f"task.name = {task.name!r} is not a task: use echo_digits, reverse_digits or jsonl"
    )
