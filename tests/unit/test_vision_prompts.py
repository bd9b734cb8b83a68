"""Rows with images: read from JSONL (paths against the file's folder, data URLs, HF `datasets`
Image features), rendered through the vision-language checkpoint's chat template with each image
expanded to its placeholder run (vision/prompts.py), and a bad image as one line naming the row."""

import base64
import dataclasses
import io
import json
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch

from torchtitan_rl.config import ConfigError, ModelSection
from torchtitan_rl.config.task import SourceSection
from torchtitan_rl.tasks.dataset import DatasetKeys, read_rows
from torchtitan_rl.tasks.render import build_renderer, image_reader
from torchtitan_rl.types import Prompt
from torchtitan_rl.vision.prompts import expand, prompt_images

REPO = Path(__file__).resolve().parents[2]
VL = REPO / "assets" / "tiny_vl_muse_glimmer"
PATCH, IMAGE_START, IMAGE_END = 68, 69, 70
KEYS = DatasetKeys(messages_key="messages")


def _png(height: int, width: int, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    PIL.Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def _renderer(name: str = "muse_glimmer", flavor: str = "tiny_vl", checkpoint: Path = VL):
    model = ModelSection(name=name, flavor=flavor, hf_checkpoint=str(checkpoint))
    source = SourceSection(name="dataset", messages_key="messages", chat_template=True)
    return build_renderer(source, str(checkpoint), 512, images=image_reader(model))


def _write(folder: Path, rows: list[dict]) -> Path:
    path = folder / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _user(*parts) -> dict:
    return {"messages": [{"role": "user", "content": list(parts)}], "answer": "3"}


def test_rows_bring_images_by_path_data_url_or_datasets_feature(tmp_path):
    """An image part by a path relative to the JSONL file's folder, by a data URL (as
    `image_url`) or as an HF `datasets` Image feature ({"bytes", "path"}): each prompt keeps
    its images in order and its messages their parts; text parts alone become a string."""
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "a.png").write_bytes(_png(28, 56))
    url = "data:image/png;base64," + base64.b64encode(_png(56, 28, seed=1)).decode()
    rows = [
        _user({"type": "image", "image": "images/a.png"}, {"type": "text", "text": "how many?"}),
        _user(
            {"type": "text", "text": "compare "},
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "image", "image": {"bytes": None, "path": str(tmp_path / "images/a.png")}},
        ),
        _user({"type": "text", "text": "no "}, {"type": "text", "text": "image"}),
    ]
    first, second, third = read_rows(str(_write(tmp_path, rows)), KEYS)
    assert first.images == (str(tmp_path / "images" / "a.png"),)
    assert first.text == "how many?"
    assert second.images == (url, str(tmp_path / "images" / "a.png"))
    assert [p["type"] for p in second.messages[0]["content"]] == ["text", "image", "image"]
    assert third.images == () and third.messages[0]["content"] == "no image"


def test_the_renderer_expands_each_image_to_its_run_and_finds_it(tmp_path):
    """Through the tiny VL checkpoint's chat template: each image part is one `<|patch|>`,
    expanded to `<|image_start|>` + (h * w / 4) `<|patch|>` + `<|image_end|>`; `Images` says
    where each run starts, and holds the patch rows and grids."""
    (tmp_path / "a.png").write_bytes(_png(28, 84))
    (tmp_path / "b.png").write_bytes(_png(56, 56, seed=2))
    prompt = read_rows(
        str(
            _write(
                tmp_path,
                [
                    _user(
                        {"type": "image", "image": "a.png"},
                        {"type": "text", "text": "and"},
                        {"type": "image", "image": "b.png"},
                    )
                ],
            )
        ),
        KEYS,
    )[0]
    renderer = _renderer()
    (ids,), (images,) = renderer.encode_images([prompt])
    assert images.grid_thw_N3.tolist() == [[1, 2, 6], [1, 4, 4]]
    assert images.lengths == (3, 4) and images.pixel_values_PX.shape == (12 + 16, 1176)
    first, second = images.starts
    assert ids[first - 1 : first + 4] == [IMAGE_START, PATCH, PATCH, PATCH, IMAGE_END]
    assert ids[second - 1] == IMAGE_START and ids[second + 4] == IMAGE_END
    assert renderer.tokenizer.decode(ids[first + 4 : second - 1]) == "and"
    assert ids.count(PATCH) == 7
    # The same prompt twice gives the same ids (one prompt's samples share them).
    assert renderer.encode([prompt]) == [ids]


def test_a_text_only_template_or_text_with_the_placeholder_is_refused():
    """The count of `<|patch|>` in the rendered text must be the images': a template that
    writes none, or a user's text that types one, is one line."""
    grid = torch.tensor([[1, 2, 2]])
    assert expand("a<|patch|>b", grid, 2) == "a<|image_start|><|patch|><|image_end|>b"
    with pytest.raises(ValueError) as e:
        expand("a <|patch|> b <|patch|>", grid, 2)
    assert str(e.value) == (
        "the rendered prompt has 2 <|patch|> but the row has 1 image(s): the chat template must "
        "write one <|patch|> per image part, and the text none"
    )
    with pytest.raises(ValueError, match=r"runs have \[2\] tokens but its images need \[1\]"):
        prompt_images([5, PATCH, PATCH, 6], torch.zeros(4, 1176), grid, PATCH, 2)


def _bad(tmp_path: Path, image) -> str:
    prompt = Prompt(
        text="",
        answer="",
        row="rows.jsonl:7",
        messages=({"role": "user", "content": [{"type": "image", "image": image}]},),
        images=(image,),
    )
    with pytest.raises(ConfigError) as e:
        _renderer().encode([prompt])
    assert "\n" not in str(e.value)
    return str(e.value)


def test_a_file_that_is_not_an_image_is_one_line_naming_the_row(tmp_path):
    (tmp_path / "notes.png").write_text("not a picture")
    message = _bad(tmp_path, str(tmp_path / "notes.png"))
    assert message.startswith(f"rows.jsonl:7: image 0: image file '{tmp_path / 'notes.png'}' is")
    assert message.endswith(
        "not an image PIL can decode (UnidentifiedImageError: cannot identify image file '"
        + str(tmp_path / "notes.png")
        + "'): give a PNG, JPEG, GIF, WebP or BMP"
    )


def test_a_missing_path_is_one_line_naming_the_row(tmp_path):
    message = _bad(tmp_path, str(tmp_path / "gone.png"))
    assert message.startswith(
        f"rows.jsonl:7: image 0: image path '{tmp_path / 'gone.png'}' does not exist"
    )


def test_a_zero_sized_image_is_one_line_naming_the_row(tmp_path):
    message = _bad(tmp_path, PIL.Image.new("RGB", (0, 5)))
    assert message == "rows.jsonl:7: image 0: image is 0x5 pixels: give an image of at least 1x1"


def test_a_too_large_image_is_one_line_naming_the_row(tmp_path):
    """The size is read from the file's header, before decoding (the limit lowered here to
    keep the file small)."""
    from torchtitan_rl.vision import preprocess

    (tmp_path / "big.png").write_bytes(_png(300, 200))
    renderer = _renderer()
    renderer.images.config = dataclasses.replace(renderer.images.config, max_image_pixels=10_000)
    prompt = Prompt(text="", answer="", row="rows.jsonl:7", images=(str(tmp_path / "big.png"),))
    with pytest.raises(ConfigError) as e:
        renderer.encode([prompt])
    assert str(e.value) == (
        f"rows.jsonl:7: image 0: image file '{tmp_path / 'big.png'}' is 200x300 pixels, more "
        "than max_image_pixels=10000: shrink it before use, or raise "
        "ImageProcessorConfig.max_image_pixels"
    )
    assert preprocess.MAX_IMAGE_PIXELS == 8192 * 8192


def test_images_for_a_model_that_reads_none_are_one_line(tmp_path):
    (tmp_path / "a.png").write_bytes(_png(28, 28))
    prompt = read_rows(str(_write(tmp_path, [_user({"type": "image", "image": "a.png"})])), KEYS)[0]
    renderer = _renderer("muse_glimmer", "tiny", REPO / "assets" / "tiny_muse_glimmer")
    assert renderer.images is None
    with pytest.raises(ConfigError) as e:
        renderer.encode([prompt])
    assert str(e.value) == (
        f"{tmp_path / 'rows.jsonl'}:1: the prompt has 1 image(s), but the model reads no "
        "images: use a vision-language flavor (muse_glimmer tiny_vl, 30B_mm), or drop the "
        "rows' image parts"
    )


def test_the_30b_mm_recipe_takes_a_screenshot_and_the_generator_plans_within_the_model():
    """The recipe's prompt length takes a 1024x768 image (972 placeholders) with its text, and
    its model length the prompt and the sampled tokens; the generator's encoder budget never
    plans an image of more placeholders than the engine's model length leaves its run."""
    import tomllib
    from types import SimpleNamespace

    from torchtitan_rl.generator.vision import most_image_tokens
    from torchtitan_rl.vision.preprocess import (
        ImageProcessorConfig,
        grid_thw_for,
        placeholder_count,
    )

    recipe = tomllib.loads((REPO / "run_configs" / "muse_glimmer_30b_mm.toml").read_text())
    screenshot = placeholder_count(grid_thw_for(768, 1024, ImageProcessorConfig()), 2)
    assert screenshot == 972
    prompt_len = recipe["training"]["max_prompt_len"]
    assert screenshot + 2 + 200 <= prompt_len  # its markers and a paragraph of text
    sampled = recipe["generator"]["sampling"]["max_tokens"]
    assert prompt_len + sampled <= recipe["generator"]["max_model_len"]
    assert prompt_len + sampled <= recipe["training"]["micro_batch_tokens"]
    config = SimpleNamespace(torchtitan_max_image_tokens=4096)
    assert most_image_tokens(config, 2048) == 2046
    assert most_image_tokens(config, 8192) == 4096
    assert most_image_tokens(SimpleNamespace(torchtitan_max_image_tokens=300), 2048) == 300
