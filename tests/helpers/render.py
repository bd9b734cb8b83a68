"""The tiny checkpoints' chat renderers for environment and agent tasks, as the environment
and gateway tests use them (tests/unit/test_envs.py, tests/unit/test_gateway.py,
tests/integration/test_envs.py)."""

import torch
from helpers.launch import REPO, TINY

from torchtitan_rl.config import ModelSection, TaskSection
from torchtitan_rl.tasks.render import Renderer, build_renderer, image_reader


def chatter_renderer() -> Renderer:
    """The renderer a task with the user_envs:Chatter environment builds (prompts <= 32)."""
    task = TaskSection(name="env", env="user_envs:Chatter", dataset_path=str(REPO / "data"))
    return build_renderer(task, TINY, max_prompt_len=32)


def vision_renderer() -> Renderer:
    """The renderer of an environment or agent task on the tiny vision-language Muse Glimmer
    (prompts <= 256), which reads images."""
    checkpoint = str(REPO / "assets" / "tiny_vl_muse_glimmer")
    model = ModelSection(name="muse_glimmer", flavor="tiny_vl", hf_checkpoint=checkpoint)
    task = TaskSection(name="agent", agent="x:y", dataset_path=str(REPO / "data"))
    return build_renderer(task, checkpoint, max_prompt_len=256, images=image_reader(model))


def same_images(a, b) -> bool:
    """Whether two `Images` hold the same rows and grids, placed alike."""
    return (
        torch.equal(a.pixel_values_PX, b.pixel_values_PX)
        and torch.equal(a.grid_thw_N3, b.grid_thw_N3)
        and (a.starts, a.lengths) == (b.starts, b.lengths)
    )


def encode(renderer: Renderer, text: str) -> list[int]:
    return renderer.tokenizer.encode(text, add_special_tokens=False)
