"""Muse Glimmer's vision tower as the project builds it (models/vision.py) against HF
transformers' `MuseGlimmerForConditionalGeneration` on the tiny vision-language checkpoint
(assets/tiny_vl_muse_glimmer, scripts/make_tiny_checkpoint.py)."""

from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch

from tests.helpers.titan import torchtitan_model
from torchtitan_rl.models import model_spec
from torchtitan_rl.models.vision import (
    VisionEncoder,
    VisionLanguageModel,
    encoder_inputs,
    encoder_rows,
)
from torchtitan_rl.types import Images
from torchtitan_rl.vision.preprocess import ImageProcessorConfig, placeholder_count, preprocess

REPO = Path(__file__).resolve().parents[2]
CHECKPOINT = REPO / "assets" / "tiny_vl_muse_glimmer"
PATCH, IMAGE_START, IMAGE_END = 68, 69, 70


def _images(*sizes: tuple[int, int], seed: int = 0) -> list[PIL.Image.Image]:
    rng = np.random.default_rng(seed)
    return [PIL.Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


def _prompt(grid_thw_N3: torch.Tensor) -> list[int]:
    """Text, then each image's placeholder run between its markers, then text."""
    ids = [3, 10, 11]
    for grid in grid_thw_N3:
        ids += [IMAGE_START] + [PATCH] * placeholder_count(grid, 2) + [IMAGE_END] + [12, 13]
    return ids + [14, 4, 3, 15]


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(CHECKPOINT, attn_implementation="eager")


@pytest.fixture(scope="module")
def titan_model():
    return torchtitan_model(str(CHECKPOINT), "tiny_vl", "muse_glimmer")


def test_the_tokenizer_and_config_name_the_image_markers():
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(CHECKPOINT)
    ids = tokenizer.convert_tokens_to_ids(["<|patch|>", "<|image_start|>", "<|image_end|>"])
    assert ids == [PATCH, IMAGE_START, IMAGE_END]
    assert AutoConfig.from_pretrained(CHECKPOINT).image_token_id == PATCH
    # The text ids are the text-only tiny checkpoint's.
    text_only = AutoTokenizer.from_pretrained(REPO / "assets" / "tiny_muse_glimmer")
    assert tokenizer("abc 12")["input_ids"] == text_only("abc 12")["input_ids"]


def test_images_of_different_shapes_give_hf_logits(hf_model, titan_model):
    """Two images in one prompt, neither square (4x6 and 4x2 patches: windowed attention over
    2x2 windows, the learned positions resampled to each grid), through the encoder, the
    adapter, the projection and the scaleless norm into the decoder: HF's logits within the
    family's fp32 bound (test_tiny_checkpoint.py), at every position."""
    config = ImageProcessorConfig.from_checkpoint(CHECKPOINT)
    pixel_values_PX, grid_thw_N3 = preprocess(_images((56, 84), (60, 30)), config)
    assert grid_thw_N3.tolist() == [[1, 4, 6], [1, 4, 2]]
    tokens_1T = torch.tensor([_prompt(grid_thw_N3)])
    with torch.no_grad():
        hf_logits = hf_model(
            input_ids=tokens_1T, pixel_values=pixel_values_PX, image_grid_thw=grid_thw_N3
        ).logits[0]
        positions_1T = torch.arange(tokens_1T.shape[1])[None]
        ours = titan_model(
            tokens_1T,
            positions=positions_1T,
            vision=_inputs(tokens_1T[0], pixel_values_PX, grid_thw_N3),
        )[0]
        # torchtitan's own injection, at every placeholder id, gives the same.
        theirs = titan_model(
            tokens_1T,
            positions=positions_1T,
            pixel_values=encoder_rows(pixel_values_PX, grid_thw_N3, 14, 2),
            grid_thw=grid_thw_N3,
            special_tokens={"image_id": PATCH},
        )[0]
        text_only = titan_model(tokens_1T, positions=positions_1T)[0]
    torch.testing.assert_close(ours, hf_logits, rtol=1e-5, atol=1e-4)
    assert torch.equal(ours, theirs)
    # The images are read: without them, the placeholders' logits are another model's.
    assert (text_only - hf_logits).abs().max() > 0.1


def _inputs(tokens_T: torch.Tensor, pixel_values_PX, grid_thw_N3, offset: int = 0):
    """The encoder's inputs for a prompt `tokens_T` holding the images' placeholder runs."""
    ids = tokens_T.tolist()
    starts = tuple(i for i, t in enumerate(ids) if t == PATCH and (i == 0 or ids[i - 1] != PATCH))
    lengths = tuple(placeholder_count(g, 2) for g in grid_thw_N3)
    images = Images(pixel_values_PX, grid_thw_N3, starts, lengths)
    return encoder_inputs([images], [offset], 14, 2)


def test_a_placeholder_id_the_completion_samples_is_read_as_text(titan_model):
    """A sampled `<|patch|>` after the prompt is a token like any other (as the generator
    reads it): the features go where the prompt's images are, and torchtitan's injection
    (every placeholder id) would refuse the row."""
    config = ImageProcessorConfig.from_checkpoint(CHECKPOINT)
    pixel_values_PX, grid_thw_N3 = preprocess(_images((28, 56)), config)
    prompt = _prompt(grid_thw_N3)
    tokens_1T = torch.tensor([prompt + [20, PATCH, PATCH, 21]])
    vision = _inputs(torch.tensor(prompt), pixel_values_PX, grid_thw_N3)
    with torch.no_grad():
        logits = titan_model(
            tokens_1T, positions=torch.arange(tokens_1T.shape[1])[None], vision=vision
        )[0]
        alone = titan_model(
            tokens_1T[:, : len(prompt) + 1],
            positions=torch.arange(len(prompt) + 1)[None],
            vision=vision,
        )[0]
        with pytest.raises(ValueError, match="counts must match"):
            titan_model(
                tokens_1T,
                positions=torch.arange(tokens_1T.shape[1])[None],
                pixel_values=encoder_rows(pixel_values_PX, grid_thw_N3, 14, 2),
                grid_thw=grid_thw_N3,
                special_tokens={"image_id": PATCH},
            )
    torch.testing.assert_close(logits[: len(prompt) + 1], alone, rtol=1e-5, atol=1e-5)


def test_the_encoder_fixes_torchtitans_positions_for_images_not_square(hf_model, titan_model):
    """torchtitan 0.3.0's encoder samples a non-square grid's learned positions transposed;
    VisionEncoder's give HF's encoder output, and a square image's are torchtitan's own."""
    from torchtitan.models.muse_glimmer.vision_encoder import MuseGlimmerVisionEncoder

    encoder = titan_model.vision_encoder
    assert isinstance(encoder, VisionEncoder)
    config = ImageProcessorConfig.from_checkpoint(CHECKPOINT)
    for size, square in (((56, 84), False), ((84, 84), True)):
        pixel_values_PX, grid_thw_N3 = preprocess(_images(size), config)
        with torch.no_grad():
            hf_out = hf_model.model.vision_tower(
                pixel_values=pixel_values_PX, grid_thw=grid_thw_N3
            ).last_hidden_state
            ours = encoder(encoder_rows(pixel_values_PX, grid_thw_N3, 14, 2), grid_thw=grid_thw_N3)
            _, h, w = grid_thw_N3[0].tolist()
            theirs = MuseGlimmerVisionEncoder._get_pos_emb(encoder, h, w, torch.device("cpu"))
        torch.testing.assert_close(ours, hf_out, rtol=1e-5, atol=1e-5)
        mine = encoder._get_pos_emb(h, w, torch.device("cpu"))
        assert torch.equal(mine, theirs) == square


def test_images_batched_with_padding_encode_as_each_alone(titan_model):
    """Images of three sizes in one padded batch: each image's features are its features
    alone (padding rows attend to themselves only, so no NaN reaches a real row), and the
    patch rows are converted to torchtitan's (channel, temporal) layout, padded per image."""
    config = ImageProcessorConfig.from_checkpoint(CHECKPOINT)
    images = _images((28, 28), (84, 56), (56, 56), seed=1)
    pixel_values_PX, grid_thw_N3 = preprocess(images, config)
    rows_NPX = encoder_rows(pixel_values_PX, grid_thw_N3, 14, 2)
    assert rows_NPX.shape == (3, 24, 1176)
    assert torch.equal(rows_NPX[0, 4:], torch.zeros(20, 1176))
    # Row 0 of image 1 is its first patch row with the 2 frames and 3 channels swapped.
    first_row = pixel_values_PX[4].view(2, 3, 14, 14).transpose(0, 1).reshape(-1)
    assert torch.equal(rows_NPX[1, 0], first_row)
    encoder = titan_model.vision_encoder
    with torch.no_grad():
        together = encoder(rows_NPX, grid_thw=grid_thw_N3)
        alone = [
            encoder(encoder_rows(*preprocess([image], config), 14, 2), grid_thw=grid[None])
            for image, grid in zip(images, grid_thw_N3, strict=True)
        ]
    assert together.isfinite().all()
    torch.testing.assert_close(together, torch.cat(alone), rtol=1e-5, atol=1e-6)


def test_every_muse_glimmer_vision_flavor_builds_the_projects_model():
    """Every Muse Glimmer flavor with a vision tower builds `VisionLanguageModel` and
    `VisionEncoder` (dense masks), and the config refuses none of them; the text-only ones
    build none."""
    from torchtitan_rl.models import refused_parts

    for flavor in ("tiny_vl", "debugmodel_mm", "30B_mm"):
        config = model_spec("muse_glimmer", flavor).model
        assert isinstance(config, VisionLanguageModel.Config)
        assert isinstance(config.vision_encoder, VisionEncoder.Config)
        assert refused_parts("muse_glimmer", flavor) == ""
    assert model_spec("muse_glimmer", "tiny").model.vision_encoder is None
