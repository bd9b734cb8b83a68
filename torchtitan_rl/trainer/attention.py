"""The trainer's inner attention: causal over right-padded rows, or document-causal over packed
rows, where every sequence of a row attends only to itself.

    .venv/bin/python -m pytest tests/unit/test_packing.py

torchtitan's attention hands its inner attention `attention_masks` unchanged: None for
right-padded rows, a `Documents` (torchtitan's `VarlenMetadata`: cumulative document starts)
for packed ones. `platform.packed_attention_kernel()` picks the packed kernel: varlen flash
attention on CUDA; on CPU (no varlen kernel, no FlexAttention backward) SDPA per document,
which measured fastest (docs/trainer_and_generator.md, "Packed micro-batches"). gpt-oss's
layers (a sliding `window`, or attention sinks: torchtitan passes their rescale as
`out_transform`) run `sink_attention` on both, per document. Shapes: B rows, L tokens, N heads,
H head dim.
"""

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torchtitan.models.common.attention import ScaledDotProductAttention, VarlenMetadata
from torchtitan.protocols.module import Module

# The kernels are plain torch (packed_attention.py); imported here as this module's names.
from torchtitan_rl.trainer.packed_attention import (  # noqa: F401
    causal_sdpa,
    masked_sdpa,
    per_document,
    runs,
    sdpa_per_document,
    sink_attention,
    spans,
    varlen,
)

Documents = VarlenMetadata


def documents(lengths: list[int], device: torch.device) -> Documents:
    """The `Documents` of one packed row holding sequences of `lengths`, in order."""
    starts = [0]
    for length in lengths:
        starts.append(starts[-1] + length)
    cu = torch.tensor(starts, dtype=torch.int32, device=device)
    longest = max(lengths, default=0)
    return VarlenMetadata(cu, cu, longest, longest, tuple(starts))


class DocumentCausalAttention(Module):
    """torchtitan inner attention: causal SDPA over right-padded rows when `attention_masks`
    is None, the document-causal `Config.packed` kernel over a packed row when it is
    `Documents` (`platform.use_platform_attention` picks it: varlen on CUDA)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        packed: Callable[..., torch.Tensor] = sdpa_per_document
        """Attention of one packed row: fn(q, k, v, docs, scale=, enable_gqa=)."""
        window: int | None = None
        """The layer's sliding window (gpt-oss's sliding layers), None: causal over all keys."""

    def __init__(self, config: Config | None = None):
        super().__init__()
        config = config or self.Config()
        # Right-padded rows run torchtitan's own SDPA module (its backend priority on CUDA).
        self.padded = ScaledDotProductAttention(ScaledDotProductAttention.Config())
        self.packed = config.packed
        self.window = config.window

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks=None, scale=None, **kwargs):
        enable_gqa = kwargs.get("enable_gqa", False)
        out_transform = kwargs.get("out_transform")
        if self.window is not None or out_transform is not None:
            kernel = functools.partial(
                sink_attention, window=self.window, out_transform=out_transform
            )
            if attention_masks is None:
                return kernel(q_BLNH, k_BLNH, v_BLNH, scale=scale, enable_gqa=enable_gqa)
            return per_document(
                kernel, q_BLNH, k_BLNH, v_BLNH, attention_masks, scale=scale, enable_gqa=enable_gqa
            )
        if attention_masks is None:
            return self.padded(q_BLNH, k_BLNH, v_BLNH, scale=scale, enable_gqa=enable_gqa)
        return self.packed(
            q_BLNH, k_BLNH, v_BLNH, attention_masks, scale=scale, enable_gqa=enable_gqa
        )
