"""Stand-ins for calls that run only on CUDA, written from each call's documentation, so that
the code path that makes the call runs on CPU (docs/cuda_contracts.md lists every such call).

    .venv/bin/python -m pytest tests/unit/test_cuda_contracts.py

A stand-in does what the documentation says the real call does, refuses what it says the real
call refuses, and nothing more. Each is checked against its documentation's examples in
tests/unit/test_cuda_contracts.py before anything is checked with it. Shapes: T packed
tokens, N query heads, K key/value heads, H head dim.
"""

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
