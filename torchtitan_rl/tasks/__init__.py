"""Tasks: where prompts come from and how completions are rewarded; the registry the `task`
config section chooses from.

    .venv/bin/python -m pytest tests/unit/test_tasks.py
"""

from torchtitan_rl.config import ConfigError, TaskSection
from torchtitan_rl.tasks.base import Task
from torchtitan_rl.tasks.dataset import DatasetKeys, DatasetTask
from torchtitan_rl.tasks.toy import EchoDigitsTask, ReverseDigitsTask

__all__ = ["Task", "build_task", "dataset_keys"]


def dataset_keys(task: TaskSection):
    return DatasetKeys(
        prompt_key=task.prompt_key,
        messages_key=task.messages_key,
        answer_key=task.answer_key,
        answer_format=task.answer_format,
    )


def build_task(task: TaskSection, seed: int) -> Task:
    if task.name == "echo_digits":
        return EchoDigitsTask(num_digits=task.num_digits, seed=seed)
    if task.name == "reverse_digits":
        return ReverseDigitsTask(num_digits=task.num_digits, seed=seed)
    if task.name in ("dataset", "env"):
        return DatasetTask(task.dataset_path, dataset_keys(task), seed=seed)
    raise ConfigError(
        f"task.name = {task.name!r} is not a task: use echo_digits, reverse_digits, dataset or env"
    )
