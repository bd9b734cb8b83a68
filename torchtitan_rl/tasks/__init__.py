"""Tasks: where prompts come from and how completions are rewarded."""

from torchtitan_rl.tasks.base import Prompt, Task, build_task

__all__ = ["Prompt", "Task", "build_task"]
