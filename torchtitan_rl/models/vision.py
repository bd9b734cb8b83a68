"""Muse Glimmer with its vision tower as the trainer and the generator run it: torchtitan's
`MuseGlimmerVisionEncoder` with its attention masks dense, so that it runs on CPU and
backpropagates there; `VisionLanguageModel`, which writes the images' features where the
caller says (not wherever a placeholder id is: a completion may sample one); and the
conversion of prompts' images to the encoder's input.

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
H heads, Dh head dim; V placeholder tokens of all images, B rows of L tokens, D model dim.
"""

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torchtitan.models.muse_glimmer.model import MuseGlimmerModel
from torchtitan.models.muse_glimmer.vision_encoder import MuseGlimmerVisionEncoder
from torchtitan.protocols.module import Module

from torchtitan_rl import platform
from torchtitan_rl.types import Images


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

    def _compute_sparse_perm_winid(self, grids: list[list[int]], max_num_patch: int, device):
        """torchtitan's (perm, inv, win_id) [N, P] of the windowed layers, planned on the host
        from the grids and uploaded: torchtitan's boolean-indexes a device tensor per image
        (`idx[idx != -1]`), a read of the device each. Each image's patches are ordered
        window by window (pos_emb_grid_h x pos_emb_grid_w windows, row-major), row-major in
        each; the padded tail keeps the identity and window id -1."""
        perm_NP = torch.arange(max_num_patch).repeat(len(grids), 1)
        inv_NP = perm_NP.clone()
        win_id_NP = torch.full_like(perm_NP, -1, dtype=torch.int32)
        for i, (_, h, w) in enumerate(grids):
            perm_P, win_id_P = window_order(h, w, self.pos_emb_grid_h, self.pos_emb_grid_w)
            perm_NP[i, : h * w] = perm_P
            inv_NP[i, : h * w] = torch.argsort(perm_P)
            win_id_NP[i, : h * w] = win_id_P
        return tuple(platform.upload(t, device) for t in (perm_NP, inv_NP, win_id_NP))

    def _build_padded_masks(self, num_patch_N, win_id_NP, max_num_patch: int, device):
        num_patch_N = platform.upload(num_patch_N, device)  # from a host grid: no read back
        p = torch.arange(max_num_patch, device=device)
        valid_NP = p[None, :] < num_patch_N[:, None]
        self_PP = torch.eye(max_num_patch, dtype=torch.bool, device=device)
        global_NPP = valid_NP[:, :, None] & valid_NP[:, None, :]
        window_NPP = global_NPP & (win_id_NP[:, :, None] == win_id_NP[:, None, :])
        return (global_NPP | self_PP)[:, None], (window_NPP | self_PP)[:, None]


def window_order(h: int, w: int, window_h: int, window_w: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The patches of an h x w grid (raster indices) ordered window by window, and each one's
    window (windows of window_h x window_w, row-major over the grid padded to whole windows;
    torchtitan's `_get_sparse_perm_and_slens`), on the host with no value-dependent op."""
    row_H1, col_1W = torch.arange(h)[:, None], torch.arange(w)[None, :]
    windows_across = -(-w // window_w)
    window_HW = (row_H1 // window_h) * windows_across + col_1W // window_w
    inside_HW = (row_H1 % window_h) * window_w + col_1W % window_w
    perm_P = torch.argsort((window_HW * (window_h * window_w) + inside_HW).flatten())
    return perm_P, window_HW.flatten()[perm_P].to(torch.int32)


@dataclass(frozen=True, slots=True)
class EncoderInputs:
    """A forward's images, as `VisionLanguageModel` reads them: each distinct image's patch
    rows on the device, its grid on the host (the encoder plans its windows and positions from
    it without reading the device), and where its features go. Rows that show the same images
    (a prompt's n samples share its `Images`) share one encoding."""

    rows: tuple[torch.Tensor, ...]
    """Each distinct image's patch rows [1, P_i, X], torchtitan's layout (`encoder_rows`)."""
    grids: tuple[torch.Tensor, ...]
    """Each distinct image's grid [1, 3] (1, h, w), on the host."""
    where_V: torch.Tensor
    """Each placeholder token's index in the forward's flattened tokens [B * L], image by
    image."""
    take_V: torch.Tensor
    """Each placeholder token's feature: its index in the distinct images' features, image
    after image."""

    def to(self, device: torch.device) -> "EncoderInputs":
        rows = tuple(platform.upload(r, device) for r in self.rows)
        where_V, take_V = (platform.upload(t, device) for t in (self.where_V, self.take_V))
        return EncoderInputs(rows, self.grids, where_V, take_V)


def each_image(
    pixel_values_PX: torch.Tensor, grid_thw_N3: torch.Tensor, patch_size: int, temporal: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each image's patch rows [1, P_i, X] in torchtitan's layout (`encoder_rows`) and its grid
    [1, 3] on the host, from the images' rows concatenated in HF's layout: what
    `VisionLanguageModel.image_features` encodes, one image at a time."""
    grid_thw_N3 = grid_thw_N3.cpu()
    counts = (grid_thw_N3[:, 1] * grid_thw_N3[:, 2]).tolist()
    return [
        (encoder_rows(pixels_PX, grid_3[None], patch_size, temporal), grid_3[None])
        for pixels_PX, grid_3 in zip(pixel_values_PX.split(counts), grid_thw_N3, strict=True)
    ]


def encoder_inputs(
    images: list[Images | None], offsets: list[int], patch_size: int, temporal: int
) -> EncoderInputs | None:
    """The encoder's inputs for sequences whose prompts' `images` start at `offsets` in the
    forward's flattened tokens (None: no image among them). Built on the host. Sequences given
    the same `Images` object (a prompt's samples) have its images encoded once."""
    encoded, where, take = [], [], []
    first: dict[int, int] = {}  # id of an Images: where its features start
    features = 0
    for prompt_images, offset in zip(images, offsets, strict=True):
        if prompt_images is None:
            continue
        if id(prompt_images) not in first:
            first[id(prompt_images)] = features
            features += sum(prompt_images.lengths)
            encoded += each_image(
                prompt_images.pixel_values_PX, prompt_images.grid_thw_N3, patch_size, temporal
            )
        feature = first[id(prompt_images)]
        for start, length in zip(prompt_images.starts, prompt_images.lengths, strict=True):
            where.append(torch.arange(offset + start, offset + start + length))
            take.append(torch.arange(feature, feature + length))
            feature += length
    if not encoded:
        return None
    rows, grids = zip(*encoded, strict=True)
    return EncoderInputs(rows, grids, torch.cat(where), torch.cat(take))


class VisionLanguageModel(MuseGlimmerModel):
    """torchtitan's Muse Glimmer with its vision tower, the images' features written at the
    positions `EncoderInputs.where_V` names: projected, normed and scattered into the token
    embeddings, as torchtitan's `_inject_vision` writes them at every placeholder id (which a
    sampled completion may hold too, and which reads the device to find the runs).

    Each image is encoded alone, so that its features do not depend on the images beside it:
    the trainer's micro-batch and the generator's batch hold different ones, and under
    batch-invariant mode the two give the same bits (tests/dist/batch_invariant_run.py)."""

    @dataclass(kw_only=True, slots=True)
    class Config(MuseGlimmerModel.Config):
        pass

    def image_features(self, rows_1PX: torch.Tensor, grid_13: torch.Tensor) -> torch.Tensor:
        """[V_i, D] of one image: the encoder, the adapter, the projection and the scaleless
        norm."""
        features = self.vision_adapter(self.vision_encoder(rows_1PX, grid_thw=grid_13))
        return self.perception_emb_norm(self.vision_projection(features))

    def embed_images(self, h_BLD: torch.Tensor, vision: EncoderInputs) -> torch.Tensor:
        """The token embeddings `h_BLD` with the images' features at their placeholders."""
        features_UD = torch.cat(
            [self.image_features(r, g) for r, g in zip(vision.rows, vision.grids, strict=True)]
        )
        # Each placeholder's feature (rows showing one image read its one encoding; backward
        # sums their gradients into it).
        features_VD = features_UD.index_select(0, vision.take_V).to(h_BLD.dtype)
        return h_BLD.flatten(0, 1).index_copy(0, vision.where_V, features_VD).view_as(h_BLD)

    def forward(self, tokens, positions=None, attention_masks=None, *, vision=None, **kwargs):
        if vision is None:
            return super().forward(tokens, positions, attention_masks, **kwargs)
        h_BLD = self.embed_images(self.tok_embeddings(tokens), vision)
        for layer in self.layers.values():
            h_BLD = layer(h_BLD, attention_masks, positions)
        h_BLD = self.norm(h_BLD)
        return h_BLD if self._skip_lm_head else self.lm_head(h_BLD)


def parallelize_vision_language(model: "VisionLanguageModel", **options):
    """torchtitan's parallelize steps for Muse Glimmer as this project runs them: Qwen3's dense
    ones over the text tower (`parallelize_qwen3`: the TP plan where TP is on, activation
    checkpointing, compile, FSDP; torchtitan's `parallelize_muse_glimmer` refuses every spmd
    backend but "spmd_types", which this project does not run), then the vision encoder's
    blocks under the same activation checkpointing, as torchtitan's wraps them (its adapter,
    two linears, stays as it is). The encoder's blocks are no FSDP unit of their own (its
    parameters are the root's), so wrapping them after FSDP leaves what FSDP gathers as it
    was. `training.compile` refuses Muse Glimmer (its windowed layers: trainer/compile.py)."""
    from torchtitan.models.qwen3.parallelize import parallelize_qwen3

    model = parallelize_qwen3(model, **options)
    ac_config = options.get("ac_config")
    if ac_config is not None and getattr(model, "vision_encoder", None) is not None:
        ac_config.build(dump_folder=options.get("dump_folder")).apply(model.vision_encoder)
    return model


VISION_PARTS = ("vision_encoder", "vision_adapter", "vision_projection")
"""The modules of a vision-language model's vision tower (the scaleless norm has no
parameters); `model.freeze_vision` freezes them."""


def vision_parameters(model: torch.nn.Module):
    """The parameters of `model`'s vision tower (none for a text-only model)."""
    for part in VISION_PARTS:
        module = getattr(model, part, None)
        if module is not None:
            yield from module.parameters()


def use_vision_language_model(model_config) -> "MuseGlimmerModel.Config":
    """A Muse Glimmer config with a vision tower as `VisionLanguageModel`'s, its encoder
    `VisionEncoder` with `MaskedAttention`; parameter names stay torchtitan's. A text-only
    config is returned as it is."""
    encoder = model_config.vision_encoder
    if encoder is None:
        return model_config
    block = encoder.block
    block.attn = dataclasses.replace(block.attn, inner_attention=MaskedAttention.Config())
    model_config.vision_encoder = _as(VisionEncoder.Config, encoder)
    return _as(VisionLanguageModel.Config, model_config)


def _as(config_class, config):
    return config_class(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)})


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
