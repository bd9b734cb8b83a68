"""Stand-ins for calls that run only on CUDA, written from each call's documentation, so that
the code path that makes the call runs on CPU (docs/cuda_contracts.md lists every such call).

    .venv/bin/python -m pytest tests/unit/test_cuda_contracts.py

A stand-in does what the documentation says the real call does, refuses what it says the real
call refuses, and nothing more. Each is checked against its documentation's examples in
tests/unit/test_cuda_contracts.py before anything is checked with it. Shapes: T packed
tokens, N query heads, K key/value heads, H head dim.
"""

import itertools
import math

import torch

# flash-attn's README ("Requirements": fp16 and bf16) and its error for other dtypes;
# torch's varlen_attn calls aten._flash_attention_forward, the same kernels.
FLASH_DTYPES = (torch.float16, torch.bfloat16)


def varlen_attn(
    query,
    key,
    value,
    cu_seq_q,
    cu_seq_k,
    max_q,
    max_k,
    *,
    return_aux=None,
    scale=None,
    window_size=(-1, -1),
    enable_gqa=False,
    seqused_k=None,
    block_table=None,
    num_splits=None,
):
    """`torch.nn.attention.varlen.varlen_attn` (torch 2.13) on CPU, from its docstring:
    query (T_q, N, H), key/value (T_k, K, H); `cu_seq_*` (int32) the cumulative sequence
    starts, `max_*` the longest lengths; `window_size` (left, right): (-1, -1) full attention
    (the default), (-1, 0) causal, (W, 0) causal with a window of W; `enable_gqa` lets K < N
    (N divisible by K); returns (T_q, N, H) in the query's dtype. The checks on heads are its
    own, word for word."""
    if query.dtype not in FLASH_DTYPES:
        raise RuntimeError("FlashAttention only support fp16 and bf16 data type")
    if return_aux is not None or seqused_k is not None or block_table is not None:
        raise NotImplementedError("stand-in: return_aux, seqused_k, block_table are unused here")
    num_heads_q, num_heads_k = query.size(1), key.size(1)
    if not enable_gqa and num_heads_q != num_heads_k:
        raise ValueError(
            f"Expect query and key/value to have the same number of heads "
            f"but got Hq={num_heads_q} and Hkv={num_heads_k}. "
            f"Try setting enable_gqa=True for GQA."
        )
    if enable_gqa and num_heads_q % num_heads_k != 0:
        raise ValueError(
            f"Expect number of query heads to be a multiple of kv heads for GQA "
            f"but got Hq={num_heads_q} and Hkv={num_heads_k}."
        )
    return attend(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window_size)


def attend(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=None, window_size=(-1, -1)):
    """The attention `varlen_attn` documents, in float64 whatever the input dtype, returned in
    the query's dtype and differentiable: each sequence's queries attend to its own keys only.
    Where query and key lengths differ, the window is aligned to the bottom right (flash-attn's
    README: "the causal mask is aligned to the bottom right corner")."""
    if cu_seq_q.dtype != torch.int32 or cu_seq_k.dtype != torch.int32:
        raise RuntimeError("cu_seqlens_q and cu_seqlens_k must have dtype int32")
    starts_q, starts_k = cu_seq_q.tolist(), cu_seq_k.tolist()
    if len(starts_q) != len(starts_k):
        raise RuntimeError("cu_seq_q and cu_seq_k must describe the same number of sequences")
    if starts_q[-1] != query.size(0) or starts_k[-1] != key.size(0):
        raise RuntimeError("the last cumulative start must be the total number of tokens")
    lengths_q = [e - s for s, e in zip(starts_q, starts_q[1:], strict=False)]
    lengths_k = [e - s for s, e in zip(starts_k, starts_k[1:], strict=False)]
    if max(lengths_q) > max_q or max(lengths_k) > max_k:
        raise RuntimeError(f"max_q/max_k ({max_q}, {max_k}) below the longest sequence")
    N, K, H = query.size(1), key.size(1), query.size(2)
    scale = 1 / math.sqrt(H) if scale is None else scale
    left, right = window_size
    outs = []
    bounds_q = zip(starts_q, starts_q[1:], strict=False)
    bounds_k = zip(starts_k, starts_k[1:], strict=False)
    for (sq, eq), (sk, ek) in zip(bounds_q, bounds_k, strict=True):
        q_NlH = query[sq:eq].double().transpose(0, 1)
        k_NlH = key[sk:ek].double().transpose(0, 1).repeat_interleave(N // K, dim=0)
        v_NlH = value[sk:ek].double().transpose(0, 1).repeat_interleave(N // K, dim=0)
        i = torch.arange(eq - sq)[:, None] + (ek - sk) - (eq - sq)  # bottom-right aligned
        j = torch.arange(ek - sk)[None, :]
        allowed = torch.ones_like(i * j, dtype=torch.bool)
        if left >= 0:
            allowed &= j >= i - left
        if right >= 0:
            allowed &= j <= i + right
        scores = (q_NlH @ k_NlH.transpose(1, 2)) * scale
        weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1).nan_to_num(0.0)
        outs.append((weights @ v_NlH).transpose(0, 1))
    return torch.cat(outs).to(query.dtype)


def flash_attn_varlen_func(
    q,
    k,
    v,
    max_seqlen_q,
    cu_seqlens_q,
    max_seqlen_k,
    cu_seqlens_k=None,
    seqused_k=None,
    q_v=None,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=None,
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
    return_softmax_lse=False,
    out=None,
    scheduler_metadata=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    num_splits=0,
    output_scale=None,
    fa_version=3,
    s_aux=None,
    cp_world_size=1,
    cp_rank=0,
    cp_tot_seqused_k=None,
    mask_mod=None,
    block_sparse_tensors=None,
    aux_tensors=None,
    aux_tensor_leading_dims=None,
    dynamic_causal=None,
):
    """vLLM 0.32's `vllm.vllm_flash_attn.flash_attn_varlen_func` on CPU, from its docstring:
    q (total_q, nheads, headdim); k/v (total_k, nheads_k, headdim) with `cu_seqlens_k`, or a
    paged cache (num_blocks, block_size, nheads_k, headdim) with `block_table` (batch,
    max_blocks_per_seq; int32) and `seqused_k` (batch; int32: the keys each sequence uses;
    "mutually exclusive with cu_seqlens_k, and required when block_table is given");
    nheads divisible by nheads_k (head i of q attends to head i // (nheads / nheads_k));
    `cu_seqlens_q` int32 cumulative starts; `softmax_scale` 1/sqrt(headdim) by default;
    `causal` aligned to the bottom right; `window_size` None or (-1, -1): no window;
    `num_splits` 0 (the kernel's choice) or 1 on FA2. fp16/bf16 only (flash-attn's kernels).
    Its compiled op has no backward: the result does not require grad. The stand-in takes
    the paths the trainer uses (no sinks, softcap, alibi, dropout) and refuses the rest."""
    if q.dtype not in FLASH_DTYPES:
        raise RuntimeError("FlashAttention only support fp16 and bf16 data type")
    unused = (q_v, alibi_slopes, s_aux, out, scheduler_metadata)
    if any(x is not None for x in unused) or softcap or dropout_p:
        raise NotImplementedError("stand-in: sinks, softcap, alibi, dropout, scheduling")
    if (cu_seqlens_k is None) == (seqused_k is None) or (block_table is None) != (
        seqused_k is None
    ):
        raise RuntimeError("cu_seqlens_k, or block_table with seqused_k")
    if q.size(1) % k.size(-2):
        raise RuntimeError("Number of heads in key/value must divide number of heads in query")
    if num_splits < 0 or (fa_version == 2 and num_splits > 1) or fa_version not in (2, 3, 4):
        raise RuntimeError(f"stand-in: num_splits {num_splits}, fa_version {fa_version}")
    if block_table is not None:  # the paged cache, read sequence by sequence
        if block_table.dtype != torch.int32 or seqused_k.dtype != torch.int32:
            raise RuntimeError("block_table and seqused_k must have dtype int32")
        used = seqused_k.tolist()
        k, v = (
            torch.cat([x[row].flatten(0, 1)[:n] for row, n in zip(block_table, used, strict=True)])
            for x in (k, v)
        )
        cu_seqlens_k = torch.tensor([0, *itertools.accumulate(used)], dtype=torch.int32)
    left, right = (-1, -1) if window_size is None else window_size
    if causal:
        right = 0
    with torch.no_grad():
        return attend(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            softmax_scale,
            (left, right),
        )


def get_flash_attn_version(
    requires_alibi=False,
    head_size=None,
    head_size_v=None,
    has_sinks=False,
    requires_softcap=False,
    kv_cache_block_size=None,
    supports_fa4_hd256=False,
):
    """vLLM 0.32's `fa_utils.get_flash_attn_version` on a Hopper GPU without overrides, under
    VLLM_BATCH_INVARIANT: FA3 (its step 1: SM90 prefers it), FA2 with alibi; a head size
    over 256 would take FA4, which batch invariance turns into FA2."""
    if requires_alibi or (head_size or 0) > 256:
        return 2
    return 3


class SleepingEngine:
    """vLLM 0.32 `LLMEngine.sleep(level=1, mode="abort")` / `wake_up(tags=None)` (its
    signatures), recording the calls. Level 1, from `LLM.sleep`'s docstring: "Offload model
    weights to CPU, discard KV cache", so the weights come back on `wake_up`."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.asleep = False

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        if self.asleep:
            raise RuntimeError("stand-in: sleep() while asleep")
        self.calls.append(("sleep", level))
        self.asleep = True

    def wake_up(self, tags: list[str] | None = None) -> bool:
        if not self.asleep:
            raise RuntimeError("stand-in: wake_up() while awake")
        self.calls.append(("wake_up", tags))
        self.asleep = False
        return True


class Recorder:
    """A callable that records its calls (for `torch.cuda.set_device`,
    `dist.init_process_group`, torchtitan's `set_batch_invariance`): the order matters."""

    def __init__(self, name: str, log: list, returns=None):
        self.name, self.log, self.returns = name, log, returns

    def __call__(self, *args, **kwargs):
        self.log.append((self.name, args, kwargs))
        return self.returns
