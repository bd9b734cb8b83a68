"""Tasks: where prompts come from and how completions are rewarded; the registry the `task`
config section (or each of its task.sources) chooses from.

    .venv/bin/python -m pytest tests/unit/test_tasks.py
"""

from torchtitan_rl.config import ConfigError
from torchtitan_rl.config.task import SourceSection
from torchtitan_rl.tasks.base import Task
from torchtitan_rl.tasks.dataset import DatasetKeys, DatasetTask
from torchtitan_rl.tasks.reasoning_gym import ReasoningGymTask
from torchtitan_rl.tasks.toy import EchoDigitsTask, ReverseDigitsTask

__all__ = ["Task", "build_task", "dataset_keys"]


def dataset_keys(task: SourceSection, at: str = "task"):
    """The row keys of the source `task` (the config section `at`)."""
    return DatasetKeys(
        prompt_key=task.prompt_key,
        messages_key=task.messages_key,
        answer_key=task.answer_key,
        answer_format=task.answer_format,
        at=at,
    )


def build_task(task: SourceSection, seed: int, at: str = "task") -> Task:
    """The task of source section `task` (the config section `at`)."""
    if task.name == "echo_digits":
        return EchoDigitsTask(num_digits=task.num_digits, seed=seed)
    if task.name == "reverse_digits":
        return ReverseDigitsTask(num_digits=task.num_digits, seed=seed)
    if task.name in ("dataset", "env", "agent"):
        return DatasetTask(
            task.dataset_path, dataset_keys(task, at), seed=seed, field=f"{at}.dataset_path"
        )
    if task.name == "reasoning_gym":
        return ReasoningGymTask(task, seed=seed, at=at)
    raise ConfigError(
        f"{at}.name = {task.name!r} is not a task: use echo_digits, reverse_digits, dataset, "
        "env, agent or reasoning_gym"
    )
