"""The trainer's inner attention: causal over right-padded rows, or document-causal over packed
rows, where every sequence of a row attends only to itself.

    .venv/bin/python -m pytest tests/unit/test_packing.py

torchtitan's attention hands its inner attention `attention_masks` unchanged: None for
right-padded rows, a `Documents` (torchtitan's `VarlenMetadata`: cumulative document starts)
for packed ones. `platform.packed_attention_kernel()` picks the packed kernel: varlen flash
attention on CUDA; on CPU (no varlen kernel, no FlexAttention backward) SDPA per document,
which measured fastest (docs/trainer_and_generator.md, "Packed micro-batches"). Shapes: B rows,
L tokens, N heads, H head dim.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torchtitan.models.common.attention import ScaledDotProductAttention, VarlenMetadata
from torchtitan.protocols.module import Module

Documents = VarlenMetadata


def documents(lengths: list[int], device: torch.device) -> Documents:
    """The `Documents` of one packed row holding sequences of `lengths`, in order."""
    starts = [0]
    for length in lengths:
        starts.append(starts[-1] + length)
    cu = torch.tensor(starts, dtype=torch.int32, device=device)
    longest = max(lengths, default=0)
    return VarlenMetadata(cu, cu, longest, longest, tuple(starts))


def spans(docs: Documents) -> list[tuple[int, int]]:
    """(start, end) of each document of the row."""
    starts = docs.cu_seq_q_host or tuple(docs.cu_seq_q.tolist())
    return [(s, e) for s, e in zip(starts, starts[1:], strict=False) if e > s]


def causal_sdpa(q_BLNH, k_BLNH, v_BLNH, scale=None, enable_gqa=False, mask_LL=None):
    """SDPA of (B, L, N, H) rows: causal, or under `mask_LL` (True: may attend) when given."""
    out_BNLH = F.scaled_dot_product_attention(
        q_BLNH.transpose(1, 2),
        k_BLNH.transpose(1, 2),
        v_BLNH.transpose(1, 2),
        attn_mask=mask_LL,
        scale=scale,
        is_causal=mask_LL is None,
        enable_gqa=enable_gqa,
    )
    return out_BNLH.transpose(1, 2)


def per_document(kernel, q_1LNH, k_1LNH, v_1LNH, docs: Documents, **kwargs) -> torch.Tensor:
    """`kernel` (causal attention of (1, l, N, H) rows) run on each document's slice of the
    packed row, the outputs concatenated back in place."""
    outs = [
        kernel(q_1LNH[:, s:e], k_1LNH[:, s:e], v_1LNH[:, s:e], **kwargs) for s, e in spans(docs)
    ]
    return torch.cat(outs, dim=1)


def sdpa_per_document(q_1LNH, k_1LNH, v_1LNH, docs: Documents, scale=None, enable_gqa=False):
    """CPU: causal SDPA on each document's slice (sum of l^2 work, not L^2). Consecutive
    documents of one length (first-fit decreasing puts them side by side; uniform lengths are
    all alike) run as one batch: a view of the row, one SDPA call."""
    outs = []
    for start, length, count in runs(docs):
        end = start + length * count
        q, k, v = (
            x[:, start:end].unflatten(1, (count, length))[0] for x in (q_1LNH, k_1LNH, v_1LNH)
        )
        out = causal_sdpa(q, k, v, scale=scale, enable_gqa=enable_gqa)
        outs.append(out.flatten(0, 1)[None])
    return torch.cat(outs, dim=1)


def runs(docs: Documents) -> list[tuple[int, int, int]]:
    """(start, length, count) of each run of consecutive documents of one length."""
    out: list[tuple[int, int, int]] = []
    for s, e in spans(docs):
        if out and out[-1][1] == e - s and out[-1][0] + out[-1][1] * out[-1][2] == s:
            start, length, count = out[-1]
            out[-1] = (start, length, count + 1)
        else:
            out.append((s, e - s, 1))
    return out


def masked_sdpa(q_1LNH, k_1LNH, v_1LNH, docs: Documents, scale=None, enable_gqa=False):
    """SDPA over the whole row with a block-diagonal causal mask (measured against
    `sdpa_per_document` in scripts/bench/packed_attention.py; not the default)."""
    L = q_1LNH.shape[1]
    doc_L = torch.zeros(L, dtype=torch.int32, device=q_1LNH.device)
    for index, (s, e) in enumerate(spans(docs)):
        doc_L[s:e] = index
    position = torch.arange(L, device=q_1LNH.device)
    mask_LL = (doc_L[:, None] == doc_L[None, :]) & (position[:, None] >= position[None, :])
    return causal_sdpa(q_1LNH, k_1LNH, v_1LNH, scale, enable_gqa, mask_LL=mask_LL)


def varlen(q_1LNH, k_1LNH, v_1LNH, docs: Documents, scale=None, enable_gqa=False):
    """CUDA: flash attention over the packed tokens with cumulative document starts."""
    from torch.nn.attention.varlen import varlen_attn

    L, H = q_1LNH.shape[1], q_1LNH.shape[-1]
    q, k, v = (x.reshape(L, -1, H).to(torch.bfloat16) for x in (q_1LNH, k_1LNH, v_1LNH))
    kwargs = {"enable_gqa": True} if enable_gqa else {}
    out_LNH = varlen_attn(
        q, k, v, docs.cu_seq_q, docs.cu_seq_k, docs.max_q, docs.max_k, scale=scale, **kwargs
    )
    return out_LNH.view(1, L, -1, H).to(q_1LNH.dtype)


class DocumentCausalAttention(Module):
    """torchtitan inner attention: causal SDPA over right-padded rows when `attention_masks`
    is None, the document-causal `Config.packed` kernel over a packed row when it is
    `Documents` (`platform.use_platform_attention` picks it: varlen on CUDA)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        packed: Callable[..., torch.Tensor] = sdpa_per_document
        """Attention of one packed row: fn(q, k, v, docs, scale=, enable_gqa=)."""

    def __init__(self, config: Config | None = None):
        super().__init__()
        # Right-padded rows run torchtitan's own SDPA module (its backend priority on CUDA).
        self.padded = ScaledDotProductAttention(ScaledDotProductAttention.Config())
        self.packed = (config or self.Config()).packed

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks=None, scale=None, **kwargs):
        enable_gqa = kwargs.get("enable_gqa", False)
        if attention_masks is None:
            return self.padded(q_BLNH, k_BLNH, v_BLNH, scale=scale, enable_gqa=enable_gqa)
        return self.packed(
            q_BLNH, k_BLNH, v_BLNH, attention_masks, scale=scale, enable_gqa=enable_gqa
        )
