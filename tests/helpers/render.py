"""The tiny checkpoint's chat renderer for an environment task, as the environment tests use
it (tests/unit/test_envs.py, tests/integration/test_envs.py)."""

from helpers.launch import REPO, TINY

from torchtitan_rl.config import TaskSection
from torchtitan_rl.tasks.render import Renderer, build_renderer


def chatter_renderer() -> Renderer:
    """The renderer a task with the user_envs:Chatter environment builds (prompts <= 32)."""
    task = TaskSection(name="env", env="user_envs:Chatter", dataset_path=str(REPO / "data"))
    return build_renderer(task, TINY, max_prompt_len=32)


def encode(renderer: Renderer, text: str) -> list[int]:
    return renderer.tokenizer.encode(text, add_special_tokens=False)
