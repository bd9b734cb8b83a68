"""Batch-invariant CPU kernels: a row's result never depends on how many rows come with it.

    .venv/bin/python -m pytest tests/unit/test_batch_invariant.py

Measured here (torch 2.13 CPU, MKL/oneDNN, 1 and 2 threads; docs/batch_invariant.md):
- fp32 GEMM: a row's result changes with the number of rows M for M < 12, and is the same for
  every M >= 12 that was tried (up to 4096) and at any position. An output column's changes
  with the number of outputs N below 16 (N = 1, 2, 4-8 and 16 and up each round alike, on
  AVX2): a column-parallel layer of a few outputs (Qwen3.5's per-head gate projections, 4
  wide, 2 on each of 2 TP ranks) got other bits on a TP rank than on one device (measured:
  9.5e-7 in the logprobs). Padded to a multiple of COL_TILE, every slice of 1-64 outputs at
  any offset, and wider ones, equals the same columns of a 1,024-wide GEMM. `linear` pads
  the rows to a multiple of ROW_TILE and the outputs to a multiple of COL_TILE and runs one
  GEMM; the backward is the plain one (gradients equal F.linear's bit for bit).
- bf16 GEMM on CPUs with AMX (measured on a 2-core Xeon) changes a row's result with M even
  when M is padded to a multiple of ROW_TILE (1024-wide layers: 1 vs 40 rows differ). Its
  products are exact in fp32, so `linear` multiplies bf16 inputs as fp32 (invariant wherever
  fp32 is) and rounds the result to bf16 once; without AMX fp32 GEMM is also the faster one.
- A row-parallel layer (attention output, MLP down projection) sharded over TP ranks adds
  partial products across them, which one device's GEMM does not reproduce. Where the run has
  a tensor-parallel side (batch_invariant.reduction_slices), every such layer runs its
  reduction as `partial_products`: a fixed number of slices of its input dimension, each one
  GEMM, summed by a pairwise tree in slice order, in fp32. A rank holding a contiguous whole
  part of the slices computes its subtree; the ranks' subtrees then combine in the same tree
  (`combine_partials`): the same bits on one device and on any power-of-two degree that
  divides the slice count.
- RMSNorm, log_softmax and logsumexp are row-invariant as they are.
- Elementwise sigmoid, softplus and SiLU are not where a row is narrower than ATen's vector
  loop: ATen runs a tensor's elements in vectors of 2 x 16 (fp32, AVX-512) and the remainder
  with scalar code, and the two differ in the last bit (sigmoid 3.8%, softplus 14.5% of
  100,000 values: scripts/bench/pointwise_tails.py on AVX-512). Rows of 4 (Qwen3.5's
  per-head gates) land in one or the other by the tensor's size. `pointwise` pads a tensor to
  whole vectors; exp and rsqrt agree as they are.
- SDPA is not: decoding one row alone differs from the same row in a causal forward. For P @ V
  the contraction length must not change (trailing zero keys are not neutral past ~144 keys),
  while QK^T and softmax are neutral to trailing zero keys / -inf scores. `attention` therefore
  pads keys to a multiple of KEY_CHUNK and sums P @ V over fixed-size key chunks in order, so a
  query at position t gets the same bits in a full causal forward (the trainer), a chunked
  prefill or a one-token decode (the generator).
"""

import math

import torch
import torch.nn.functional as F

ROW_TILE = 16
COL_TILE = 16
KEY_CHUNK = 64


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        rows = x.reshape(-1, x.shape[-1])
        pad, cols = -rows.shape[0] % ROW_TILE, -weight.shape[0] % COL_TILE
        weight32, bias32 = weight.float(), None if bias is None else bias.float()
        if cols:  # F.pad copies even by nothing: the wide layers (the head) skip it
            weight32 = F.pad(weight32, (0, 0, 0, cols))
            bias32 = None if bias32 is None else F.pad(bias32, (0, cols))
        y = F.linear(F.pad(rows, (0, 0, 0, pad)).float(), weight32, bias32)
        # Contiguous where the padding was cut off: collectives (vLLM's gather of a
        # vocabulary-parallel head's logits) take contiguous tensors only.
        y = y[: rows.shape[0], : weight.shape[0]].to(x.dtype).contiguous()
        # Not a view in autograd's eyes (as F.linear's own 3-D result): FSDP warns about views.
        return torch.ops.aten._unsafe_view(y, (*x.shape[:-1], weight.shape[0]))

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        grad_rows = grad_y.reshape(-1, grad_y.shape[-1])
        grad_x = (grad_rows @ weight.to(grad_rows.dtype)).reshape(x.shape)
        grad_w = grad_rows.t() @ x.reshape(-1, x.shape[-1]).to(grad_rows.dtype)
        grad_b = grad_rows.sum(0) if ctx.has_bias else None
        return grad_x, grad_w.to(weight.dtype), grad_b


LANES = 64
"""A multiple of every ATen CPU vector loop's step (2 x 32 bf16 lanes at AVX-512)."""
GRAIN = 32768
"""ATen's grain: a tensor of more elements may be split over threads at any element."""


POINTWISE = {"sigmoid": torch.sigmoid, "softplus": F.softplus, "silu": F.silu}
"""The elementwise functions `pointwise` runs, by name."""


def pointwise(fn, x: torch.Tensor) -> torch.Tensor:
    """Elementwise `fn` (one of POINTWISE) of `x` with every element computed by ATen's vector
    code, whatever `x`'s size: flattened, padded to a multiple of LANES, run in pieces of at
    most GRAIN elements (one thread each). One opaque op, `torchtitan_rl::pointwise`, to
    torch.compile: vLLM traces its decoder once with every guard dropped, and a loop over the
    pieces would be frozen at the traced size (measured: traced at 1,000 tokens, 40,000
    raised). Differentiable."""
    if fn.__name__ not in POINTWISE:
        raise ValueError(f"ops.pointwise runs {', '.join(POINTWISE)}, not {fn.__name__}")
    return torch.ops.torchtitan_rl.pointwise(x, fn.__name__)


def _in_pieces(x: torch.Tensor, fn: str) -> torch.Tensor:
    flat = x.reshape(-1)
    n = flat.numel()
    padded = F.pad(flat, (0, -n % LANES))
    pieces = [POINTWISE[fn](piece) for piece in padded.split(GRAIN)]
    return torch.cat(pieces)[:n].view(x.shape) if pieces else torch.empty_like(x)


@torch.library.custom_op("torchtitan_rl::pointwise", mutates_args=())
def _pointwise(x: torch.Tensor, fn: str) -> torch.Tensor:
    return _in_pieces(x, fn).clone()  # a fresh tensor, as a custom op's output must be


@_pointwise.register_fake
def _(x, fn):
    return torch.empty_like(x)


def _keep(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.fn = inputs[1]


def _pointwise_backward(ctx, grad):
    # The same pieces under autograd: each piece's derivative as ATen's vector code gives it.
    (x,) = ctx.saved_tensors
    with torch.enable_grad():
        _, vjp = torch.func.vjp(lambda t: _in_pieces(t, ctx.fn), x)
    return vjp(grad)[0], None


_pointwise.register_autograd(_pointwise_backward, setup_context=_keep)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """F.linear whose result for a row depends only on that row (rows padded to ROW_TILE), and
    for an output only on its weight row (outputs padded to COL_TILE): a column-parallel
    layer's shard gives the whole layer's columns."""
    return _Linear.apply(x, weight, bias)


def tree_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """parts[0] + ... + parts[-1] as a pairwise tree: the left half's sum plus the right
    half's. For a power-of-two count, any aligned block of the parts is one subtree, which is
    what lets ranks holding blocks sum them first."""
    if len(parts) == 1:
        return parts[0]
    half = len(parts) // 2
    return tree_sum(parts[:half]) + tree_sum(parts[half:])


def partial_products(x: torch.Tensor, weight: torch.Tensor, width: int) -> torch.Tensor:
    """x @ weight.T in fp32 with its reduction in canonical order: the input dimension cut
    into slices of `width` (contiguous, in order), each slice's product one row-padded fp32
    GEMM, the slices summed by `tree_sum`. Not rounded to x's dtype: a rank's result is a
    partial sum that `combine_partials` finishes. Differentiable (the plain linear's
    gradients)."""
    return _PartialProducts.apply(x, weight, width)


class _PartialProducts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, width):
        ctx.save_for_backward(x, weight)
        rows = x.reshape(-1, x.shape[-1])
        padded = F.pad(rows, (0, 0, 0, -rows.shape[0] % ROW_TILE)).float()
        parts = [
            F.linear(
                padded[:, start : start + width].contiguous(),
                weight[:, start : start + width].float(),
            )
            for start in range(0, x.shape[-1], width)
        ]
        y = tree_sum(parts)[: rows.shape[0]]
        return torch.ops.aten._unsafe_view(y, (*x.shape[:-1], weight.shape[0]))

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        grad_rows = grad_y.reshape(-1, grad_y.shape[-1])
        grad_x = (grad_rows @ weight.to(grad_rows.dtype)).reshape(x.shape).to(x.dtype)
        grad_w = grad_rows.t() @ x.reshape(-1, x.shape[-1]).to(grad_rows.dtype)
        return grad_x, grad_w.to(weight.dtype), None


def combine_partials(y: torch.Tensor, world_size: int, all_reduce, all_gather) -> torch.Tensor:
    """Finish `partial_products` over `world_size` ranks, each holding a contiguous block of the
    slices (rank r the r-th): the ranks' subtrees summed in the tree's order. Two ranks: an
    all-reduce (a + b is b + a in IEEE arithmetic: any algorithm gives the tree's bits); more:
    every rank's partial gathered, then summed as the tree (an all-reduce's order is its
    own)."""
    if world_size == 1:
        return y
    if world_size == 2:
        return all_reduce(y)
    gathered = all_gather(y[None], 0)
    return tree_sum(list(gathered.unbind(0)))


def attention(
    q_BLNH: torch.Tensor,
    k_BSKH: torch.Tensor,
    v_BSKH: torch.Tensor,
    positions_BL: torch.Tensor,
    scale: float | None = None,
    window: int | None = None,
    with_lse: bool = False,
):
    """Causal attention of B sequences' L queries over their S keys (positions 0..S-1); the
    values may have their own head dim (multi-head latent attention's).

    Query l of sequence b sits at position positions_BL[b, l] and sees keys 0..that position,
    or with `window` the last `window` of them (itself included; gpt-oss's sliding layers).
    N query heads share K kv heads in groups of N // K (consecutive query heads per kv head,
    like SDPA's enable_gqa). Computed in fp32, returned in q's dtype; with `with_lse`, also
    each query's logsumexp of scores [B, L, N] (fp32), summed over the same key chunks in
    order, for attention sinks (torchtitan's `out_transform`).
    """
    B, L, N, H = q_BLNH.shape
    S, K = k_BSKH.shape[1], k_BSKH.shape[2]
    G = N // K
    scale = H**-0.5 if scale is None else scale
    padded = max(KEY_CHUNK, math.ceil(S / KEY_CHUNK) * KEY_CHUNK)
    tiles = math.ceil(L / ROW_TILE)
    pad = tiles * ROW_TILE - L
    batch = B * tiles * K

    def keys(x_BSKX):  # [B, S, K, X] -> [B * tiles * K, padded, X], zero keys past S
        X = x_BSKX.shape[-1]  # H, or the value head dim (MLA's differs from H)
        x_BKPX = F.pad(x_BSKX.float(), (0, 0, 0, 0, 0, padded - S)).permute(0, 2, 1, 3)
        return x_BKPX.unsqueeze(1).expand(B, tiles, K, padded, X).reshape(batch, padded, X)

    def per_query(x_bM):  # [B * tiles * K, G * ROW_TILE, ...] -> [B, L, N, ...]
        x = x_bM.view(B, tiles, K, G, ROW_TILE, *x_bM.shape[2:])
        return x.permute(0, 1, 4, 2, 3, *range(5, x.dim())).flatten(1, 2).flatten(2, 3)[:, :L]

    # Queries in tiles of ROW_TILE rows: one [G * ROW_TILE, H] block per (b, tile, kv head).
    q_bMH = (
        F.pad(q_BLNH.float(), (0, 0, 0, 0, 0, pad))
        .view(B, tiles, ROW_TILE, K, G, H)
        .permute(0, 1, 3, 4, 2, 5)
        .reshape(batch, G * ROW_TILE, H)
    )
    k_bPH, v_bPH = keys(k_BSKH), keys(v_BSKH)
    scores_bMP = torch.bmm(q_bMH, k_bPH.transpose(1, 2)) * scale
    # Padded query rows get position 0: finite, and dropped below.
    pos_bM1 = (
        F.pad(positions_BL, (0, pad))
        .view(B, tiles, 1, 1, ROW_TILE)
        .expand(B, tiles, K, G, ROW_TILE)
        .reshape(batch, G * ROW_TILE, 1)
    )
    key_P = torch.arange(padded, device=q_BLNH.device).view(1, 1, padded)
    hidden = key_P > pos_bM1
    if window is not None:
        hidden = hidden | (key_P <= pos_bM1 - window)
    scores_bMP = scores_bMP.masked_fill(hidden, float("-inf"))
    probs_bMP = torch.softmax(scores_bMP, dim=-1)
    # P @ V over fixed-size key chunks, summed in order: the contraction length never changes.
    out_bMH = None
    for start in range(0, padded, KEY_CHUNK):
        chunk = slice(start, start + KEY_CHUNK)
        part = torch.bmm(probs_bMP[:, :, chunk], v_bPH[:, chunk])
        out_bMH = part if out_bMH is None else out_bMH + part
    out_BLNH = per_query(out_bMH).to(q_BLNH.dtype)
    if not with_lse:
        return out_BLNH
    # The same for the logsumexp: the max is exact, the sum runs over the key chunks in order.
    max_bM1 = scores_bMP.amax(-1, keepdim=True)
    total_bM = None
    for start in range(0, padded, KEY_CHUNK):
        part = (scores_bMP[:, :, start : start + KEY_CHUNK] - max_bM1).exp().sum(-1)
        total_bM = part if total_bM is None else total_bM + part
    return out_BLNH, per_query(max_bM1[..., 0] + total_bM.log())


def invariance_failures(dim: int, heads: int, head_dim: int, dtype: torch.dtype) -> list[str]:
    """Check, on this machine's threads and ISA, what the kernels above promise: a row and an
    output of `linear` and a query of `attention` get the same bits alone as among many.
    Returns what differs (empty: invariant). Random data of the model's width and dtype;
    about 10 ms."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, dim, generator=g).to(dtype)
    weight = torch.randn(2 * dim, dim, generator=g).to(dtype)
    failures = []
    together = linear(x, weight)
    for rows in (slice(0, 1), slice(7, 8), slice(0, 13), slice(5, 40)):
        if not torch.equal(linear(x[rows], weight), together[rows]):
            failures.append(f"linear rows {rows.start}..{rows.stop - 1} alone vs 40 rows")
    for cols in (slice(0, 2), slice(2, 4), slice(8, 24), slice(dim, 2 * dim)):
        if not torch.equal(linear(x, weight[cols]), together[:, cols]):
            failures.append(f"linear outputs {cols.start}..{cols.stop - 1} alone vs {2 * dim}")
    L, H = 80, head_dim
    q, k, v = (torch.randn(1, L, heads, H, generator=g).to(dtype) for _ in range(3))
    positions = torch.arange(L)[None]
    for window in (None, 24):
        full, full_lse = attention(q, k, v, positions, window=window, with_lse=True)
        for t in (0, 63, 79):  # decode one query over the keys so far
            kv = (k[:, : t + 1], v[:, : t + 1], positions[:, t : t + 1])
            alone, lse = attention(q[:, t : t + 1], *kv, window=window, with_lse=True)
            same = torch.equal(alone, full[:, t : t + 1])
            if not (same and torch.equal(lse, full_lse[:, t : t + 1])):
                failures.append(
                    f"attention query {t} (window {window}) decoded alone vs in a causal forward"
                )
    return failures
