"""The gated delta rule of Qwen3.5's linear-attention layers, in plain torch: the chunked form
the trainer runs over whole sequences (with autograd), the recurrent form the generator runs
token by token, and the short causal convolution before it. Both forms take and return the
recurrent state, so a sequence may be cut anywhere (a prefill, then decodes).

    .venv/bin/python -m pytest tests/unit/test_gated_delta.py

Per value head, with the state S (K x V), a token's decay g (< 0), its write strength beta in
(0, 1), its L2-normed key k and query q (the query scaled by K^-1/2), and its value v:

    S <- exp(g) S;    S <- S + k (beta (v - k^T S))^T;    o = S^T q

The chunked form computes the same over chunks of `CHUNK` tokens with the WY representation
(one triangular solve per chunk, then one state update per chunk); it is what `fla`'s
`chunk_gated_delta_rule` computes, which the trainer runs instead on CUDA where `fla` is
installed (platform.gated_delta_rule). Shapes: B sequences, L tokens, H value heads, K key
dim, V value dim, C chunk length, N chunks. Computed in fp32; outputs in the inputs' dtype.
"""

import torch
import torch.nn.functional as F

CHUNK = 64
"""The chunk length of the chunked form (fla's and HF's)."""


def l2_normed(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """`x` over its last dim's L2 norm, as fla's kernels take q and k (`use_qk_l2norm`)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def heads(mixed_BLC: torch.Tensor, key_heads: int, key_dim: int, value_dim: int):
    """q, k [B, L, H, K] (the `key_heads` heads repeated to the H value heads) and v
    [B, L, H, V] from a layer's convolved q|k|v channels."""
    width = key_heads * key_dim
    q, k, v = mixed_BLC.split([width, width, mixed_BLC.shape[-1] - 2 * width], dim=-1)
    v = v.unflatten(-1, (-1, value_dim))
    q, k = (
        x.unflatten(-1, (key_heads, key_dim)).repeat_interleave(v.shape[2] // key_heads, dim=2)
        for x in (q, k)
    )
    return q, k, v


def _prepared(q_BLHK, k_BLHK, v_BLHV, g_BLH, beta_BLH):
    """fp32, heads first, q and k L2-normed and q scaled: [B, H, L, *]."""
    scale = q_BLHK.shape[-1] ** -0.5
    q = l2_normed(q_BLHK.float()).transpose(1, 2) * scale
    k = l2_normed(k_BLHK.float()).transpose(1, 2)
    return (
        q,
        k,
        v_BLHV.float().transpose(1, 2),
        g_BLH.float().transpose(1, 2),
        beta_BLH.float().transpose(1, 2),
    )


def _state(state_BHKV: torch.Tensor) -> torch.Tensor:
    """An incoming state as fp32 and contiguous in (K, V): the reductions over K then run in
    one order whatever the caller's layout (vLLM's slots hold it (V, K): read transposed,
    a decode's sums over K ran in another order than the trainer's and moved its output by an
    ulp, measured)."""
    return state_BHKV.float().contiguous()


def chunked(q_BLHK, k_BLHK, v_BLHV, g_BLH, beta_BLH, state_BHKV=None, chunk: int = CHUNK):
    """The outputs [B, L, H, V] and the final state [B, H, K, V] (fp32) of the gated delta
    rule over L tokens from `state_BHKV` (zeros where None), chunk by chunk; differentiable."""
    dtype = v_BLHV.dtype
    q, k, v, g, beta = _prepared(q_BLHK, k_BLHK, v_BLHV, g_BLH, beta_BLH)
    B, H, L, K = k.shape
    pad = -L % chunk
    # Padded tokens write nothing (beta 0, k 0) and decay nothing (g 0).
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    N = (L + pad) // chunk
    q, k, v = (x.reshape(B, H, N, chunk, -1) for x in (q, k, v))
    g = g.reshape(B, H, N, chunk).cumsum(-1)
    beta = beta.reshape(B, H, N, chunk, 1)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    strict = causal.clone().fill_diagonal_(False)
    # decay[i, j] = exp(g_i - g_j) for j <= i: the decay from token j's write to token i.
    decay = (g[..., :, None] - g[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta, v_beta = k * beta, v * beta
    # WY: T = (I + strictly lower(beta k k^T decay))^-1 turns the chunk's sequential writes
    # into u = T v_beta (what each token writes from a zero state) and w = T k_beta exp(g)
    # (how much of the incoming state each token's write removes).
    lower = ((k_beta @ k.transpose(-1, -2)) * decay).masked_fill(~strict, 0)
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    t = torch.linalg.solve_triangular(
        eye + lower, eye.expand_as(lower), upper=False, unitriangular=True
    )
    u = t @ v_beta
    w = t @ (k_beta * g.exp()[..., None])
    scores = (q @ k.transpose(-1, -2)) * decay
    S = q.new_zeros(B, H, K, v.shape[-1]) if state_BHKV is None else _state(state_BHKV)
    outputs = []
    for n in range(N):
        g_n = g[:, :, n]
        new = u[:, :, n] - w[:, :, n] @ S
        outputs.append((q[:, :, n] * g_n.exp()[..., None]) @ S + scores[:, :, n] @ new)
        last = g_n[..., -1:]
        S = (
            S * last.exp()[..., None]
            + (k[:, :, n] * (last - g_n).exp()[..., None]).transpose(-1, -2) @ new
        )
    o = torch.cat(outputs, dim=2)[:, :, :L]
    return o.transpose(1, 2).to(dtype), S


def recurrent(q_BLHK, k_BLHK, v_BLHV, g_BLH, beta_BLH, state_BHKV=None):
    """`chunked`'s outputs and final state, one token at a time (the generator's decode)."""
    dtype = v_BLHV.dtype
    q, k, v, g, beta = _prepared(q_BLHK, k_BLHK, v_BLHV, g_BLH, beta_BLH)
    B, H, L, K = k.shape
    S = q.new_zeros(B, H, K, v.shape[-1]) if state_BHKV is None else _state(state_BHKV)
    outputs = []
    for t in range(L):
        S = S * g[:, :, t].exp()[..., None, None]
        k_t = k[:, :, t, :, None]
        delta = (v[:, :, t] - (S * k_t).sum(-2)) * beta[:, :, t, None]
        S = S + k_t * delta[..., None, :]
        outputs.append((S * q[:, :, t, :, None]).sum(-2))
    o = torch.stack(outputs, dim=2) if outputs else v.new_zeros(B, H, 0, v.shape[-1])
    return o.transpose(1, 2).to(dtype), S


def recurrent_side_by_side(sequences, padding: float = 2.0):
    """`recurrent`'s outputs for sequences of different lengths, each from a zero state, in
    few token loops: longest first, sequences join a group while its tokens padded to the
    group's longest stay within `padding` times its own (autograd keeps a state a padded
    token, so memory stays within that factor of the sequences' own), and each group runs
    once, its (q, k, v, g, beta) padded at their ends and stacked on the batch dim. A
    sequence's outputs are the bits `recurrent` gives it alone (each op of the loop computes
    a sequence's values as it would alone; the generator's batches of requests rely on the
    same), in as many steps as each group's longest has tokens instead of as all have."""
    lengths = [sequence[0].shape[1] for sequence in sequences]
    groups: list[list[int]] = []
    for i in sorted(range(len(sequences)), key=lambda i: -lengths[i]):
        group = groups[-1] if groups else []
        if not group or (len(group) + 1) * lengths[group[0]] > padding * (
            sum(lengths[j] for j in group) + lengths[i]
        ):
            groups.append(group := [])
        group.append(i)
    rows = sequences[0][0].shape[0]
    outputs = [None] * len(sequences)
    for group in groups:
        longest = lengths[group[0]]
        # Padded tokens follow a sequence's last: they reach none of its outputs.
        out, _ = recurrent(
            *(
                torch.cat(
                    [F.pad(x, (0, 0) * (x.dim() - 2) + (0, longest - x.shape[1])) for x in xs]
                )
                for xs in zip(*(sequences[i] for i in group), strict=True)
            )
        )
        for slot, i in enumerate(group):
            outputs[i] = out[slot * rows : (slot + 1) * rows, : lengths[i]]
    return outputs


def step(q_BLHK, k_BLHK, v_BLHV, g_BLH, beta_BLH, state_BHKV):
    """`recurrent` over one token (L = 1) with the state updated in place where it is fp32
    and contiguous (a decode: vLLM's slots gathered), in fewer passes over the state: its
    products with k and q in one matmul, then the decay and the rank-1 write in place, with
    the output from those (o = exp(g) S^T q + delta (k . q)). Equal to `recurrent` up to
    fp32 rounding; batch-invariant mode runs `recurrent` on both sides instead."""
    dtype = v_BLHV.dtype
    q, k, v, g, beta = (x[:, :, 0] for x in _prepared(q_BLHK, k_BLHK, v_BLHV, g_BLH, beta_BLH))
    S = _state(state_BHKV)
    B, H, K, V = S.shape
    k_S, q_S = (torch.stack([k, q], dim=-2) @ S).unbind(-2)  # [B, H, V] each
    decay = g.exp()[..., None]
    delta = (v - decay * k_S) * beta[..., None]
    o = decay * q_S + delta * (k * q).sum(-1, keepdim=True)
    S.mul_(decay[..., None])
    S.view(B * H, K, V).baddbmm_(k.reshape(B * H, K, 1), delta.reshape(B * H, 1, V))
    return o[:, None].to(dtype), S


def gates(a_BLH, b_BLH, A_log_H, dt_bias_H, pointwise=None):
    """Each token's decay g = -exp(A_log) softplus(a + dt_bias) (< 0, fp32) and write
    strength beta = sigmoid(b) per value head, from the layer's a and b projections;
    `pointwise(fn, x)` applies softplus and sigmoid (batch-invariant mode's `ops.pointwise`)."""
    each = pointwise or (lambda fn, x: fn(x))
    g = -torch.exp(A_log_H.float()) * each(F.softplus, a_BLH.float() + dt_bias_H)
    return g, each(torch.sigmoid, b_BLH)


def causal_conv(x_BLC: torch.Tensor, weight_C1W: torch.Tensor, state_BCW=None):
    """The depthwise causal convolution (width W) then SiLU over L tokens [B, L, C], after
    the W - 1 inputs `state_BCW` holds (zeros where None: a sequence's start); returns the
    outputs and the last W - 1 inputs, the next call's state. Computed in fp32 as W
    elementwise products and sums in a fixed order, rounded once to the inputs' dtype:
    a token's output is the same bits whether the call has its sequence, only it, or other
    sequences beside it (the tests check it), so batch-invariant mode runs it as it is, and
    a decode's one token costs W products, not a convolution kernel's call (oneDNN's
    depthwise convolution took 0.29 ms a call on one token of 128 requests, measured)."""
    width, L = weight_C1W.shape[-1], x_BLC.shape[1]
    if state_BCW is None:
        x = F.pad(x_BLC, (0, 0, width - 1, 0))
    else:
        x = torch.cat([state_BCW.transpose(1, 2).to(x_BLC.dtype), x_BLC], dim=1)
    x32 = x.float()
    weight_WC = weight_C1W[:, 0].t().float().contiguous()  # strided rows: 5x slower
    y = x32[:, :L] * weight_WC[0]
    for i in range(1, width):
        y = y + x32[:, i : i + L] * weight_WC[i]
    return F.silu(y).to(x_BLC.dtype), x[:, L:].transpose(1, 2)
