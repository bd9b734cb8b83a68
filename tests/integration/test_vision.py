"""The generator with images: the tiny vision-language Muse Glimmer in a real vLLM engine
(compiled, as users run it), its requests carrying each prompt's images (generator/vision.py).
The trainer's side and bitwise mode: tests/unit/test_vision.py and
tests/integration/test_batch_invariant.py.

    .venv/bin/python -m pytest tests/integration/test_vision.py
"""

from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch
from helpers.titan import torchtitan_model

from torchtitan_rl.config import GeneratorSection, ModelSection
from torchtitan_rl.models.vision import encoder_inputs
from torchtitan_rl.vision.preprocess import ImageProcessorConfig, placeholder_count, preprocess
from torchtitan_rl.vision.prompts import prompt_images

REPO = Path(__file__).resolve().parents[2]
CHECKPOINT = str(REPO / "assets" / "tiny_vl_muse_glimmer")
PATCH, IMAGE_START, IMAGE_END = 68, 69, 70


@pytest.fixture(scope="module")
def engine():
    from torchtitan_rl.generator.engine import LocalGenerator

    generator = LocalGenerator(
        generator=GeneratorSection(max_model_len=256),
        model=ModelSection(name="muse_glimmer", flavor="tiny_vl", hf_checkpoint=CHECKPOINT),
    )
    yield generator
    generator.close()


def _prompt(sizes, seed: int):
    """A prompt with an image of each size (random pixels), and its Images."""
    rng = np.random.default_rng(seed)
    pictures = [PIL.Image.fromarray(rng.integers(0, 256, (*s, 3), dtype=np.uint8)) for s in sizes]
    pixel_values_PX, grid_thw_N3 = preprocess(
        pictures, ImageProcessorConfig.from_checkpoint(CHECKPOINT)
    )
    ids = [3, 10, 11]
    for grid in grid_thw_N3:
        ids += [IMAGE_START] + [PATCH] * placeholder_count(grid, 2) + [IMAGE_END] + [12]
    ids += [4, 3]
    return ids, prompt_images(ids, pixel_values_PX, grid_thw_N3, PATCH, 2)


def test_the_generator_reads_each_prompts_images_as_the_trainer_does(engine):
    """Three prompts in one batch (two images of different shapes, one image, none), two
    samples each: compiled, and every sampled token's logprob is the torchtitan model's with
    the prompt's images within 1e-4 (fp32); a sampled `<|patch|>` in a completion is text."""
    prompts = [_prompt(((56, 84), (28, 28)), 0), _prompt(((84, 56),), 1), ([3, 10, 11, 4, 3], None)]
    completions = engine.generate(
        [ids for ids, _ in prompts],
        n=2,
        temperature=1.0,
        max_tokens=8,
        seed=0,
        images=[images for _, images in prompts],
    )
    assert engine.compiled
    assert completions.images[2] is None and completions.images[0] is prompts[0][1]
    model = torchtitan_model(CHECKPOINT, "tiny_vl", "muse_glimmer")
    worst = 0.0
    for (ids, images), samples in zip(prompts, completions.samples, strict=True):
        vision = None if images is None else encoder_inputs([images], [0], 14, 2)
        for sample in samples:
            row = ids + sample.token_ids
            with torch.no_grad():
                logits = model(
                    torch.tensor([row]), positions=torch.arange(len(row))[None], vision=vision
                )
            logprobs = logits[0].log_softmax(-1)[len(ids) - 1 : -1]
            expected = logprobs.gather(1, torch.tensor(sample.token_ids)[:, None])[:, 0]
            worst = max(worst, float((expected - torch.tensor(sample.logprobs)).abs().max()))
    assert worst < 1e-4, worst


def test_the_prefix_cache_keys_on_the_images(engine):
    """The same ids with the same image again are served from the prefix cache with the same
    logprobs; with another image of the same size, the cache serves none of the image's KV,
    and the logprobs are the other image's."""
    ids, first = _prompt(((56, 56),), 2)
    _, other = _prompt(((56, 56),), 3)

    def logprobs(images):
        completions = engine.generate(
            [ids], n=1, temperature=0.0, max_tokens=4, seed=0, images=[images]
        )
        return completions.samples[0][0].logprobs

    once = logprobs(first)
    assert logprobs(first) == once
    assert max(abs(a - b) for a, b in zip(logprobs(other), once, strict=True)) > 1e-3


def test_images_the_prompt_does_not_place_are_refused(engine):
    ids, images = _prompt(((28, 56),), 4)
    with pytest.raises(ValueError, match="prompt 0: its image at 4 has no run of 2 placeholders"):
        engine.generate([ids[:5] + ids[7:]], n=1, max_tokens=2, seed=0, images=[images])
