"""Document-causal attention kernels over one packed row, in plain torch (no torchtitan import,
so `scripts/gpu_check.py` runs them on a GPU machine that has torch alone).

    .venv/bin/python -m pytest tests/unit/test_packing.py tests/unit/test_cuda_contracts.py

A packed row holds several sequences end to end; `docs` gives their cumulative starts
(torchtitan's `VarlenMetadata`: `cu_seq_q`, `cu_seq_k`, `max_q`, `max_k`, `cu_seq_q_host`).
Every sequence attends causally to itself only. Shapes: B rows, L tokens, N heads, H head dim.
"""

import math

import torch
import torch.nn.functional as F

VARLEN_DTYPES = (torch.bfloat16, torch.float16)
"""The dtypes flash attention's varlen kernel has; other dtypes run `sdpa_per_document`."""

CAUSAL_WINDOW = (-1, 0)
"""`varlen_attn`'s causal window. Its default, (-1, -1), is full attention (torch 2.13
docstring); and it tests `window_size == (-1, 0)` for is_causal, so it must be this tuple."""


def spans(docs) -> list[tuple[int, int]]:
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


def per_document(kernel, q_1LNH, k_1LNH, v_1LNH, docs, **kwargs) -> torch.Tensor:
    """`kernel` (causal attention of (1, l, N, H) rows) run on each document's slice of the
    packed row, the outputs concatenated back in place."""
    outs = [
        kernel(q_1LNH[:, s:e], k_1LNH[:, s:e], v_1LNH[:, s:e], **kwargs) for s, e in spans(docs)
    ]
    return torch.cat(outs, dim=1)


def runs(docs) -> list[tuple[int, int, int]]:
    """(start, length, count) of each run of consecutive documents of one length."""
    out: list[tuple[int, int, int]] = []
    for s, e in spans(docs):
        if out and out[-1][1] == e - s and out[-1][0] + out[-1][1] * out[-1][2] == s:
            start, length, count = out[-1]
            out[-1] = (start, length, count + 1)
        else:
            out.append((s, e - s, 1))
    return out


def sdpa_per_document(q_1LNH, k_1LNH, v_1LNH, docs, scale=None, enable_gqa=False):
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


def masked_sdpa(q_1LNH, k_1LNH, v_1LNH, docs, scale=None, enable_gqa=False):
    """SDPA over the whole row with a block-diagonal causal mask (measured against
    `sdpa_per_document` in scripts/bench/packed_attention.py; not the default)."""
    L = q_1LNH.shape[1]
    doc_L = torch.zeros(L, dtype=torch.int32, device=q_1LNH.device)
    for index, (s, e) in enumerate(spans(docs)):
        doc_L[s:e] = index
    position = torch.arange(L, device=q_1LNH.device)
    mask_LL = (doc_L[:, None] == doc_L[None, :]) & (position[:, None] >= position[None, :])
    return causal_sdpa(q_1LNH, k_1LNH, v_1LNH, scale, enable_gqa, mask_LL=mask_LL)


def sink_attention(
    q_BLNH, k_BLNH, v_BLNH, scale=None, enable_gqa=False, window=None, out_transform=None
):
    """Causal attention of (B, L, N, H) rows in plain ops, fp32 scores, for gpt-oss's layers:
    within the last `window` keys (itself included) when given, and with `out_transform`
    (torchtitan's attention-sink rescale: fn(out_BLNH, lse_BLN)) applied to the output and
    each query's logsumexp of scores. Every step is differentiable, the logsumexp included
    (without its gradient, q's and k's are wrong: tests/unit/test_models.py). Memory: the
    L x L scores of each head."""
    L, N, H = q_BLNH.shape[1:]
    q_BNLH, k_BNLH, v_BNLH = (x.transpose(1, 2).float() for x in (q_BLNH, k_BLNH, v_BLNH))
    if k_BNLH.shape[1] != N:  # GQA: consecutive query heads share a kv head (as SDPA's)
        k_BNLH, v_BNLH = (x.repeat_interleave(N // x.shape[1], dim=1) for x in (k_BNLH, v_BNLH))
    scale = H**-0.5 if scale is None else scale
    position = torch.arange(L, device=q_BLNH.device)
    back_LL = position[:, None] - position[None, :]
    visible_LL = (back_LL >= 0) if window is None else (back_LL >= 0) & (back_LL < window)
    scores_BNLL = (q_BNLH @ k_BNLH.transpose(-1, -2) * scale).masked_fill(~visible_LL, -math.inf)
    lse_BNL = torch.logsumexp(scores_BNLL, dim=-1)
    out_BLNH = ((scores_BNLL - lse_BNL[..., None]).exp() @ v_BNLH).transpose(1, 2)
    out_BLNH = out_BLNH.to(q_BLNH.dtype)
    if out_transform is None:
        return out_BLNH
    return out_transform(out_BLNH, lse_BNL.transpose(1, 2))


def varlen_arguments(q_1LNH, k_1LNH, v_1LNH, docs, scale=None, enable_gqa=False):
    """`torch.nn.attention.varlen.varlen_attn`'s (args, kwargs) for one packed row: (L, N, H)
    views of q, k, v, the documents' cumulative starts and longest length, the causal window."""
    L, H = q_1LNH.shape[1], q_1LNH.shape[-1]
    q_LNH, k_LKH, v_LKH = (x.reshape(L, -1, H) for x in (q_1LNH, k_1LNH, v_1LNH))
    args = (q_LNH, k_LKH, v_LKH, docs.cu_seq_q, docs.cu_seq_k, docs.max_q, docs.max_k)
    return args, {"scale": scale, "window_size": CAUSAL_WINDOW, "enable_gqa": enable_gqa}


def varlen(q_1LNH, k_1LNH, v_1LNH, docs, scale=None, enable_gqa=False):
    """CUDA: flash attention over the packed tokens, causal per document, in the model's
    dtype. Flash attention has bf16 and fp16 kernels only: a row of another dtype (an fp32
    model) runs `sdpa_per_document` in that dtype instead, as `platform.packed_attention_kernel`
    says when it picks this kernel, never a silent downcast."""
    if q_1LNH.dtype not in VARLEN_DTYPES:
        return sdpa_per_document(q_1LNH, k_1LNH, v_1LNH, docs, scale, enable_gqa)
    from torch.nn.attention.varlen import varlen_attn

    args, kwargs = varlen_arguments(q_1LNH, k_1LNH, v_1LNH, docs, scale, enable_gqa)
    out_LNH = varlen_attn(*args, **kwargs)
    return out_LNH.view(1, q_1LNH.shape[1], -1, q_1LNH.shape[-1])
