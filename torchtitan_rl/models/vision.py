"""Muse Glimmer's vision encoder as the trainer and the generator run it: torchtitan's
`MuseGlimmerVisionEncoder` with its attention masks dense, so that it runs on CPU and
backpropagates there, plus the conversion of the image processor's patch rows to its input.

    .venv/bin/python -m pytest tests/unit/test_vision.py

torchtitan's encoder builds FlexAttention `BlockMask`s per batch with a compiled
`create_block_mask`, which inductor's CPU code generation fails on (torch 2.13: "operands to
'?:' have different types"), and FlexAttention has no CPU backward. `VisionEncoder` builds the
same masks as booleans, (N, 1, P, P), and `MaskedAttention` runs SDPA with them: a patch
attends to the patches of its own image (global layers), or of its own window of
pos_emb_grid_h x pos_emb_grid_w patches (the windowed layers). A padding row attends to itself
alone, so that no row's softmax is over nothing (SDPA's NaN would reach real rows through
0 * NaN); padding rows are dropped before the adapter.

Shapes: N images, P patch rows of the longest, X a row's values (temporal * 3 * patch**2),
H heads, Dh head dim.
"""

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torchtitan.models.muse_glimmer.vision_encoder import MuseGlimmerVisionEncoder
from torchtitan.protocols.module import Module


class MaskedAttention(Module):
    """The vision encoder's inner attention: SDPA over (N, P, H, Dh) with a boolean
    (N, 1, P, P) mask (True: attend)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        pass

    def __init__(self, config: Config | None = None):
        super().__init__()

    def forward(self, q_NPHD, k_NPHD, v_NPHD, *, attention_masks: torch.Tensor):
        out_NHPD = F.scaled_dot_product_attention(
            q_NPHD.transpose(1, 2),
            k_NPHD.transpose(1, 2),
            v_NPHD.transpose(1, 2),
            attn_mask=attention_masks,
        )
        return out_NHPD.transpose(1, 2)


class VisionEncoder(MuseGlimmerVisionEncoder):
    """torchtitan's Muse Glimmer vision encoder with dense boolean attention masks (module
    docstring) and its learned positions fixed for images that are not square; its parameters,
    layout and every other step are torchtitan's."""

    @dataclass(kw_only=True, slots=True)
    class Config(MuseGlimmerVisionEncoder.Config):
        pass

    def _get_pos_emb(self, grid_h: int, grid_w: int, device: torch.device) -> torch.Tensor:
        """The learned position table resampled bilinearly to the image's grid_h x grid_w
        patches, in raster order (grid_sample, corners not aligned, zeros past the edge: HF's
        `get_vision_interpolation_indices_and_weights`). torchtitan 0.3.0's samples a
        non-square grid transposed: the patch at (row, col) reads the table at
        (col, row) of a grid_w x grid_h grid (tests/unit/test_vision.py)."""
        table = self.positional_embedding_vlm
        table_1DHW = table.view(self.pos_emb_grid_h, self.pos_emb_grid_w, -1).permute(2, 0, 1)[None]
        ys = torch.linspace(
            -1 + 1 / grid_h, 1 - 1 / grid_h, grid_h, device=device, dtype=table.dtype
        )
        xs = torch.linspace(
            -1 + 1 / grid_w, 1 - 1 / grid_w, grid_w, device=device, dtype=table.dtype
        )
        y_HW, x_HW = torch.meshgrid(ys, xs, indexing="ij")
        where_11P2 = torch.stack([x_HW, y_HW], dim=-1).reshape(1, 1, -1, 2)
        sampled_1D1P = F.grid_sample(table_1DHW, where_11P2, mode="bilinear", align_corners=False)
        return sampled_1D1P[0, :, 0, :].T

    def _build_padded_masks(self, num_patch_N, win_id_NP, max_num_patch: int, device):
        p = torch.arange(max_num_patch, device=device)
        valid_NP = p[None, :] < num_patch_N[:, None]
        self_PP = torch.eye(max_num_patch, dtype=torch.bool, device=device)
        global_NPP = valid_NP[:, :, None] & valid_NP[:, None, :]
        window_NPP = global_NPP & (win_id_NP[:, :, None] == win_id_NP[:, None, :])
        return (global_NPP | self_PP)[:, None], (window_NPP | self_PP)[:, None]


def use_dense_vision_attention(model_config) -> None:
    """Make a Muse Glimmer config's vision encoder (if any) build `VisionEncoder` with
    `MaskedAttention`, in place (before build); parameter names stay torchtitan's."""
    encoder = getattr(model_config, "vision_encoder", None)
    if encoder is None or isinstance(encoder, VisionEncoder.Config):
        return
    block = encoder.block
    block.attn = dataclasses.replace(block.attn, inner_attention=MaskedAttention.Config())
    model_config.vision_encoder = VisionEncoder.Config(
        **{f.name: getattr(encoder, f.name) for f in dataclasses.fields(encoder)}
    )


def encoder_rows(
    pixel_values_PX: torch.Tensor, grid_thw_N3: torch.Tensor, patch_size: int, temporal: int
) -> torch.Tensor:
    """The image processor's patch rows (all images' rows in order, each row laid out
    (temporal, channel, y, x): HF's `pixel_values`) as torchtitan's encoder reads them: padded
    per image to (N, P, X) with zeros, each row (channel, temporal, y, x)."""
    counts = (grid_thw_N3[:, 1] * grid_thw_N3[:, 2]).tolist()
    rows_PX = (
        pixel_values_PX.view(-1, temporal, 3, patch_size, patch_size)
        .transpose(1, 2)
        .reshape(pixel_values_PX.shape)
    )
    padded_NPX = rows_PX.new_zeros(len(counts), max(counts, default=0), rows_PX.shape[1])
    for i, rows in enumerate(rows_PX.split(counts)):
        padded_NPX[i, : rows.shape[0]] = rows
    return padded_NPX
