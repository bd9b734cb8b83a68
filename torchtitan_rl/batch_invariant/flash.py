"""Batch-invariant mode's trainer attention on CUDA: the generator's kernel, vLLM's flash
attention, called as vLLM's FLASH_ATTN backend calls it.

    .venv/bin/python -m pytest tests/unit/test_cuda_contracts.py -k flash

On CUDA the generator's attention is vLLM's FLASH_ATTN backend (`platform.engine_attention_
backend`), which under VLLM_BATCH_INVARIANT runs `flash_attn_varlen_func` over its paged KV
cache with one split of the keys (`num_splits=1`): a query's sum over its keys runs in one
order, whatever the batch. The trainer makes the same call on its own tokens, in the same
form: its keys and values paged in blocks of the engine's size (KV_BLOCK, which the engine is
given) and laid out as vLLM's cache is ([blocks, kv heads, block, 2 x head dim], read through
the backend's view), a block table, the keys used per sequence, no key offsets, each sequence
causal from position 0, `fa_version` as the backend asks for it. The paged form matters: with
paged keys FA2 takes its split-KV kernel (other tiles than the plain one) and FA3 packs the
GQA heads, so a contiguous call would be another kernel. vLLM's kernel has no backward:
`_FlashForward.backward` recomputes the attention with torch's own flash kernel
(`torch.nn.attention.varlen.varlen_attn`, the trainer's packed kernel on CUDA) and
differentiates that: the gradient of the same function, as activation checkpointing
recomputes a forward. Flash attention has bf16 and fp16 kernels only; the config refuses the
mode on CUDA in fp32, and for attention this module does not take (sliding windows, sinks,
values narrower than keys: `JobConfig._validate_invariant_cuda`). Written against vLLM 0.32's
source and checked through a stand-in of its documented behaviour; not yet run on a GPU.

Shapes: T tokens of the batch (rows or documents, each causal), N query heads, K kv heads, H
head dim, S sequences.
"""

import torch

from torchtitan_rl.trainer.attention import Documents
from torchtitan_rl.trainer.packed_attention import varlen_arguments

KV_BLOCK = 16
"""Tokens per KV-cache block of the generator's engine under the mode on CUDA (vLLM's CUDA
default, set explicitly: `platform.engine_kv_block_size`); the trainer pages its keys alike."""


def attention(q_BLNH, k_BLNH, v_BLNH, docs=None, scale=None) -> torch.Tensor:
    """Causal attention of B rows of L tokens (each row one sequence from position 0), or
    with `docs` (trainer.attention's `Documents` of one packed row) of each document, by
    vLLM's flash attention as its backend calls it (module docstring)."""
    B, L, N, H = q_BLNH.shape
    if docs is None:  # each row a sequence: its starts made on the device (no upload a layer)
        cu_T1 = torch.arange(0, B * L + 1, L, dtype=torch.int32, device=q_BLNH.device)
        docs = Documents(cu_T1, cu_T1, L, L, tuple(range(0, B * L + 1, L)))
    scale = H**-0.5 if scale is None else scale
    q_TNH, k_TKH, v_TKH = (x.reshape(B * L, x.shape[2], H) for x in (q_BLNH, k_BLNH, v_BLNH))
    return _FlashForward.apply(q_TNH, k_TKH, v_TKH, docs, scale).view(B, L, N, H)


def paged(k_TKH, v_TKH, docs, block: int = KV_BLOCK):
    """The keys and values of `docs`' sequences as vLLM's CUDA cache holds them: a [blocks, K,
    block, 2H] tensor, each sequence from a block's start and zeros after its end, read as the
    backend reads it ((key, value) views [blocks, block, K, H]); the block table [S, most
    blocks] and the keys used per sequence [S] (int32). Built on the device from the
    sequences' starts there (`cu_seq_q`), sized by their host copy: no upload, no read."""
    T, K, H = k_TKH.shape
    starts = docs.cu_seq_q_host
    counts = [-(-(end - start) // block) for start, end in zip(starts, starts[1:], strict=False)]
    blocks, most = sum(counts), max(counts)
    cu_S1 = docs.cu_seq_q.long()
    used_S = cu_S1[1:] - cu_S1[:-1]
    count_S = -(-used_S // block)
    first_S = torch.cumsum(count_S, 0) - count_S  # each sequence's first block
    block_B = torch.arange(blocks, device=k_TKH.device)
    seq_B = torch.bucketize(block_B, first_S, right=True) - 1
    token_BL = cu_S1[seq_B, None] + (block_B - first_S[seq_B])[:, None] * block
    token_BL = token_BL + torch.arange(block, device=k_TKH.device)
    token_BL = torch.where(token_BL < cu_S1[seq_B + 1, None], token_BL, T)  # T: the zero row
    kv_TKH2 = torch.cat([torch.cat([k_TKH, v_TKH], dim=-1), k_TKH.new_zeros(1, K, 2 * H)])
    kv_cache = kv_TKH2[token_BL.reshape(-1)].view(blocks, block, K, 2 * H)
    key_cache, value_cache = kv_cache.transpose(1, 2).contiguous().transpose(1, 2).split(H, -1)
    table_SM = first_S[:, None] + torch.arange(most, device=k_TKH.device)
    table_SM = table_SM.clamp(max=blocks - 1).int()  # past a sequence's blocks: never read
    return key_cache, value_cache, table_SM, used_S.int()


def _vllm_flash(q_TNH, k_TKH, v_TKH, docs, scale) -> torch.Tensor:
    """vLLM's FLASH_ATTN backend's call (`FlashAttentionImpl.forward`, vLLM 0.32) on these
    tokens, their keys and values paged."""
    from vllm.v1.attention.backends.fa_utils import (
        flash_attn_varlen_func,
        get_flash_attn_version,
    )

    key_cache, value_cache, table, used = paged(k_TKH, v_TKH, docs)
    return flash_attn_varlen_func(
        q_TNH,
        key_cache,
        value_cache,
        max_seqlen_q=docs.max_q,
        cu_seqlens_q=docs.cu_seq_q,
        max_seqlen_k=docs.max_k,
        seqused_k=used,
        softmax_scale=scale,
        causal=True,
        block_table=table,
        num_splits=1,
        # The backend's arguments: no alibi, sinks or softcap (refused on CUDA in this mode).
        fa_version=get_flash_attn_version(head_size=q_TNH.shape[-1], supports_fa4_hd256=True),
    )


class _FlashForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_TNH, k_TKH, v_TKH, docs, scale):
        ctx.save_for_backward(q_TNH, k_TKH, v_TKH)
        ctx.docs, ctx.scale = docs, scale
        return _vllm_flash(q_TNH, k_TKH, v_TKH, docs, scale)

    @staticmethod
    def backward(ctx, grad_TNH):
        from torch.nn.attention.varlen import varlen_attn

        q_TNH, k_TKH, v_TKH = ctx.saved_tensors
        with torch.enable_grad():
            inputs = [x.detach().requires_grad_() for x in (q_TNH, k_TKH, v_TKH)]
            gqa = q_TNH.shape[1] != k_TKH.shape[1]
            args, kwargs = varlen_arguments(*(x[None] for x in inputs), ctx.docs, ctx.scale, gqa)
            grads = torch.autograd.grad(varlen_attn(*args, **kwargs), inputs, grad_TNH)
        return *grads, None, None
