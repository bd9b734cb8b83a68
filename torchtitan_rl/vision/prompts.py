"""Prompts with images: a chat template's one `<|patch|>` per image expanded to the image's
placeholder run, as HF's `MuseGlimmerProcessor` expands it, and the prompt's `Images` (patch
rows, grids, where each run lies in the ids) that the trainer and the generator read.

    .venv/bin/python -m pytest tests/unit/test_vision_prompts.py

A chat message's content may be OpenAI-style parts: `{"type": "text", "text": ...}`,
`{"type": "image", "image": <path, data URL, bytes or PIL image>}` or `{"type": "image_url",
"image_url": {"url": <data URL or path>}}`. The checkpoint's chat template writes one
`<|patch|>` where each image part is; `expand` replaces the i-th with
`<|image_start|>` + n_i `<|patch|>` + `<|image_end|>`, n_i = the image's merged patches.
"""

from collections.abc import Sequence

import torch

from torchtitan_rl.types import Images
from torchtitan_rl.vision.preprocess import (
    IMAGE_END,
    IMAGE_START,
    IMAGE_TOKEN,
    ImageProcessorConfig,
    placeholder_count,
    preprocess,
)


def image_parts(messages: Sequence[dict]) -> list:
    """The image of each image part of `messages`, in order (what `preprocess` reads); a part
    without its image (an environment's or a user's malformed part) raises one ValueError line
    naming it."""
    found = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, str) or content is None:
            continue
        for j, part in enumerate(content):
            kind = part.get("type")
            if kind not in ("image", "image_url"):
                continue
            image = part.get(kind)
            if kind == "image_url" and isinstance(image, dict):
                image = image.get("url")
            if image is None or isinstance(image, dict | list | int | float):
                raise ValueError(
                    f"message {i}'s part {j} is an {kind} part without its image "
                    f"({str(part)[:60]}): write {_IMAGE_PART_SHAPES}"
                )
            found.append(image)
    return found


_IMAGE_PART_SHAPES = (
    '{"type": "image", "image": <path, data URL, bytes or PIL image>} or '
    '{"type": "image_url", "image_url": {"url": <data URL or path>}}'
)


def expand(text: str, grid_thw_N3: torch.Tensor, merge_size: int) -> str:
    """`text` with its i-th `<|patch|>` replaced by image i's placeholder run; a count of
    `<|patch|>` other than the images' raises one ValueError line."""
    pieces = text.split(IMAGE_TOKEN)
    if len(pieces) - 1 != len(grid_thw_N3):
        raise ValueError(
            f"the rendered prompt has {len(pieces) - 1} {IMAGE_TOKEN} but the row has "
            f"{len(grid_thw_N3)} image(s): the chat template must write one {IMAGE_TOKEN} per "
            f"image part, and the text none"
        )
    out = [pieces[0]]
    for grid, piece in zip(grid_thw_N3, pieces[1:], strict=True):
        run = IMAGE_TOKEN * placeholder_count(grid, merge_size)
        out.append(IMAGE_START + run + IMAGE_END + piece)
    return "".join(out)


def prompt_images(
    ids: Sequence[int],
    pixel_values_PX: torch.Tensor,
    grid_thw_N3: torch.Tensor,
    placeholder_id: int,
    merge_size: int,
) -> Images:
    """The `Images` of prompt `ids`, whose runs of `placeholder_id` are the images' in order;
    runs that do not match the images' counts raise one ValueError line."""
    lengths = tuple(placeholder_count(grid, merge_size) for grid in grid_thw_N3)
    starts, runs = [], []
    for i, token in enumerate(ids):
        if token != placeholder_id:
            continue
        if i and ids[i - 1] == placeholder_id:
            runs[-1] += 1
        else:
            starts.append(i)
            runs.append(1)
    if tuple(runs) != lengths:
        raise ValueError(
            f"the prompt's {IMAGE_TOKEN} runs have {runs} tokens but its images need "
            f"{list(lengths)}"
        )
    return Images(pixel_values_PX, grid_thw_N3, tuple(starts), lengths)


def join_images(first: Images | None, then: Images | None, offset: int) -> Images | None:
    """The images of a prompt that holds `first`'s, then ids with `then`'s from id `offset` on
    (a conversation's next messages: gateway/session.py)."""
    if then is None:
        return first
    then = Images(
        then.pixel_values_PX,
        then.grid_thw_N3,
        tuple(start + offset for start in then.starts),
        then.lengths,
    )
    if first is None:
        return then
    return Images(
        torch.cat([first.pixel_values_PX, then.pixel_values_PX]),
        torch.cat([first.grid_thw_N3, then.grid_thw_N3]),
        first.starts + then.starts,
        first.lengths + then.lengths,
    )


def images_before(images: Images | None, end: int) -> Images | None:
    """The images whose runs start before id `end` (those of the prompt's first `end` ids)."""
    if images is None:
        return None
    kept = sum(start < end for start in images.starts)
    if kept == len(images.starts):
        return images
    if kept == 0:
        return None
    rows = int(images.grid_thw_N3[:kept].prod(-1).sum())
    return Images(
        images.pixel_values_PX[:rows],
        images.grid_thw_N3[:kept],
        images.starts[:kept],
        images.lengths[:kept],
    )


class ImageReader:
    """A checkpoint's image processor (`ImageProcessorConfig.from_checkpoint`) and its
    placeholder id: a prompt's images to its expanded text and `Images`."""

    def __init__(self, config: ImageProcessorConfig, placeholder_id: int):
        self.config, self.placeholder_id = config, placeholder_id

    def read(self, images: Sequence) -> tuple[torch.Tensor, torch.Tensor]:
        """(pixel_values_PX, grid_thw_N3) of `images`; a bad image raises one ValueError line
        naming it (`preprocess`)."""
        return preprocess(images, self.config)

    def expand(self, text: str, grid_thw_N3: torch.Tensor) -> str:
        return expand(text, grid_thw_N3, self.config.merge_size)

    def images(self, ids: Sequence[int], pixel_values_PX, grid_thw_N3) -> Images:
        return prompt_images(
            ids, pixel_values_PX, grid_thw_N3, self.placeholder_id, self.config.merge_size
        )
