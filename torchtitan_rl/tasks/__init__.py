"""Tasks: where prompts come from and how completions are rewarded."""

from torchtitan_rl.tasks.base import OpenTask, Prompt, Task, build_task, open_task

__all__ = ["OpenTask", "Prompt", "Task", "build_task", "open_task"]
