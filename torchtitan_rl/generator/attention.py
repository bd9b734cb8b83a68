"""The torchtitan model's inner attention inside vLLM: its paged `Attention`, or in
batch-invariant mode the trainer's routine over the paged cache, as one opaque op.

    .venv/bin/python -m pytest tests/integration/test_generator.py -k compiled

vLLM compiles the decoder's forward (vllm_model.Decoder) once, at warm-up, with its guards
dropped: anything on the host inside forward (a `.tolist()`, a loop over sequences, a branch
on "is there metadata") would be traced once and frozen. vLLM's own attention is a registered
op that reads its metadata from the forward context when it runs; `paged_attend` is the same
for batch-invariant mode: a `torch.library` custom op with a fake implementation, so the
compiler sees one node of known shape, and everything host-side happens inside it, eagerly,
at every call. Shapes: L tokens of the flat batch, N query heads, K kv heads, H head dim.
"""

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from vllm.model_executor.layers.attention import Attention

from torchtitan_rl.batch_invariant import ops


@torch.library.custom_op("torchtitan_rl::paged_attend", mutates_args=())
def paged_attend(
    q_LNH: torch.Tensor,
    k_LKH: torch.Tensor,
    v_LKH: torch.Tensor,
    layer_name: str,
    scale: float,
    window: int | None,
    with_lse: bool,
    v_head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch-invariant attention of vLLM's flat batch over the layer's paged KV cache:
    (out [L, N, v_head_dim], logsumexp [L, N] fp32, empty without `with_lse`). Values narrower
    than H (multi-head latent attention's) arrive padded to H, as the cache stores them, and
    are read back unpadded, so the routine sees the trainer's shapes.

    This step's keys/values are written to the cache first (samples of one prompt share its
    prefill blocks within the same step), then each sequence's keys/values are read back in
    position order and its queries attend over them with `batch_invariant.ops.attention`, the
    trainer's routine: the sequences with as many queries in one call (the decodes, one query
    each; the samples of a prompt prefilling it), their keys padded to the longest's with
    zeros that their positions mask (a query's bits do not depend on trailing masked keys:
    `ops.attention`'s softmax and key chunks add exact zeros for them, as a decode's do beside
    a full causal forward's). Writes the cache, which the op's schema does not name (as
    vLLM's own attention op): the cache is reached through the forward context, not an
    argument.
    """
    L, N, H = q_LNH.shape
    out_LNH = q_LNH.new_zeros(L, N, v_head_dim)
    lse_LN = q_LNH.new_zeros((L, N) if with_lse else (0,), dtype=torch.float32)
    metadata, layer = _layer_context(layer_name)
    if metadata is None:  # a dummy run: nothing to attend to
        return out_LNH, lse_LN
    blocks, kv_heads, block_size, _ = layer.kv_cache.shape
    rows = layer.kv_cache.view(-1, H)  # this mode's layout in a block: (K head, k|v, slot)
    heads = torch.arange(kv_heads, device=q_LNH.device)

    # 1. Write: row of (slot s, head h, k|v) = ((block * K + h) * 2 + k|v) * bs + offset.
    slots = metadata.slot_mapping[:L]
    valid = slots >= 0
    block, offset = slots[valid] // block_size, slots[valid] % block_size
    key_rows = ((block[:, None] * kv_heads + heads) * 2) * block_size + offset[:, None]
    for rows_of, x_LKH in ((key_rows, k_LKH), (key_rows + block_size, v_LKH)):
        rows.index_copy_(0, rows_of.reshape(-1), x_LKH[valid].to(rows.dtype).reshape(-1, H))

    # 2. Read each sequence's keys/values back in position order, attend: the sequences with
    # as many queries this step in one call (the decodes; a prompt's samples' prefills).
    cache = layer.kv_cache.view(blocks, kv_heads, 2, block_size, H)
    plan = _plan(metadata, block_size, q_LNH.device)
    for used, key_S, hidden_BS, positions_BL, rows_BL in plan:
        B, longest = hidden_BS.shape
        kv_2BSKH = cache[used].permute(3, 0, 1, 4, 2, 5).reshape(2, B, -1, kv_heads, H)
        kv_2BSKH = kv_2BSKH[:, :, :longest]
        # Keys past a sequence's length (another's longer span) and, with a window, those
        # vLLM freed once out of every query's window, whose slots may hold other data now:
        # zeros, which the trainer's masked keys add too (exact zeros either way).
        if window is not None:
            hidden_BS = hidden_BS | (key_S < positions_BL[:, :1] - window + 1)
        kv_2BSKH = kv_2BSKH.masked_fill(hidden_BS[None, :, :, None, None], 0)
        args = (q_LNH[rows_BL], kv_2BSKH[0], kv_2BSKH[1][..., :v_head_dim], positions_BL)
        if with_lse:
            out, lse = ops.attention(*args, scale, window, with_lse=True)
            lse_LN[rows_BL.reshape(-1)] = lse.flatten(0, 1)
        else:
            out = ops.attention(*args, scale, window)
        out_LNH[rows_BL.reshape(-1)] = out.flatten(0, 1)
    return out_LNH, lse_LN


# The last forwards' plans: (metadata, block size) -> plan, the metadata held so that its id is
# not another's. A few: a forward whose layers sit in several KV cache groups (gpt-oss's sliding
# and full layers) has a metadata object for each.
_plans: dict[tuple[int, int], tuple] = {}


def _plan(metadata, block_size: int, device: torch.device) -> list[tuple]:
    """paged_attend's reading plan for one forward: for each query count, the sequences with it
    as (their blocks in the cache, key positions S, keys each hides [B, S] (past its
    length), their queries' positions [B, W], their queries' rows of the flat batch [B, W]).
    Made once per forward, at its first layer: the layers of a KV cache group share their
    metadata (vLLM builds it anew for every forward), so the host reads the batch's layout
    once, not once per layer."""
    key = (id(metadata), block_size)
    if key in _plans and _plans[key][0] is metadata:
        return _plans[key][1]
    starts = metadata.query_start_loc.tolist()
    lengths = metadata.seq_lens.tolist()
    groups: dict[int, list] = {}  # queries -> [(sequence, its first query row, its keys)]
    for i, n in enumerate(lengths):
        if starts[i + 1] > starts[i]:
            groups.setdefault(starts[i + 1] - starts[i], []).append((i, starts[i], n))
    plan = []
    for width, group in groups.items():
        sequences = torch.tensor([i for i, _, _ in group], device=device)
        queries = torch.tensor([first for _, first, _ in group], device=device)
        longest = max(n for *_, n in group)
        used = metadata.block_table[sequences, : -(-longest // block_size)].long()
        length_B1 = torch.tensor([n for *_, n in group], device=device)[:, None]
        key_S = torch.arange(longest, device=device)
        query_W = torch.arange(width, device=device)
        positions_BL = length_B1 - width + query_W
        rows_BL = queries[:, None] + query_W
        plan.append((used, key_S, key_S >= length_B1, positions_BL, rows_BL))
    if len(_plans) >= 4:
        del _plans[next(iter(_plans))]  # the oldest
    _plans[key] = (metadata, plan)
    return plan


@paged_attend.register_fake
def _(q_LNH, k_LKH, v_LKH, layer_name, scale, window, with_lse, v_head_dim):
    L, N, _ = q_LNH.shape
    return q_LNH.new_empty(L, N, v_head_dim), q_LNH.new_empty(
        (L, N) if with_lse else (0,), dtype=torch.float32
    )


def _layer_context(layer_name: str):
    """(this forward's attention metadata for the layer or None in a dummy run, vLLM's
    `Attention` layer named `layer_name`)."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None, None
    context = get_forward_context()
    return metadata_of(context.attn_metadata, layer_name), context.no_compile_layers[layer_name]


def metadata_of(metadata, layer_name: str | None):
    """`layer_name`'s metadata of a forward context's, or (None) any attention layer's."""
    if isinstance(metadata, list):
        metadata = metadata[0] if metadata else None
    if isinstance(metadata, dict):
        if layer_name is None:  # an attention layer's (not a Gated DeltaNet state layer's)
            found = [m for m in metadata.values() if hasattr(m, "query_start_loc")]
            return next(iter(found or metadata.values()), None)
        return metadata.get(layer_name)
    return metadata


class PagedAttention(nn.Module):
    """torchtitan inner attention backed by vLLM's paged `Attention` (causal, varlen), with
    gpt-oss's per-layer sliding `window` and attention `sinks` (the torchtitan layer's own
    parameter, so weight sync reaches it) passed to vLLM's kernel, which applies both.

    Values narrower than the keys (`v_head_dim` < `head_dim`: DeepSeek-V3's multi-head latent
    attention, its keys and values decompressed per head) are padded with zeros to the key
    width, which vLLM's CPU kernel needs, and the output's padding is dropped, as vLLM's own
    DeepSeek attention does without its MLA kernel.

    With `batch_invariant`, vLLM's Attention keeps the paged KV cache (its allocation, block
    tables, prefix caching) but the attention itself is `paged_attend`, the trainer's routine,
    and torchtitan's `out_transform` (gpt-oss's sink rescale) applies to its output here.
    """

    def __init__(
        self,
        *,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        scale: float,
        prefix: str,
        cache_config,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
        batch_invariant: bool = False,
        v_head_dim: int | None = None,
    ):
        super().__init__()
        self.batch_invariant = batch_invariant
        self.window = window
        self.v_head_dim = v_head_dim or head_dim
        self.tokens: int | None = None
        """Under TP (eager), the real rows of this forward's batch (set by the wrapper, which
        pads it)."""
        extra = {} if sinks is None else {"sinks": sinks}
        self.attn = Attention(
            n_heads,
            head_dim,
            scale,
            num_kv_heads=n_kv_heads,
            cache_config=cache_config,
            per_layer_sliding_window=window,
            prefix=prefix,  # vLLM binds each layer's KV cache by this unique name
            **extra,
        )

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, out_transform=None, **_) -> torch.Tensor:
        """`out_transform`: torchtitan's sink rescale, applied here in batch-invariant mode
        only (vLLM's kernel applies the sinks itself)."""
        if isinstance(q_BLNH, DTensor):  # TP: this rank's heads, which vLLM's attention holds
            # Only the batch's real rows (the wrapper pads it): vLLM writes each row's key and
            # value to the cache slot its slot mapping gives, and a padding row has none
            # (measured: written anyway, it corrupted a cached block; logprobs off by 6e-3).
            q, k, v = (x.to_local()[:, : self.tokens] for x in (q_BLNH, k_BLNH, v_BLNH))
            out_BLNH = self.forward(q, k, v, out_transform=out_transform)
            pad = q_BLNH.shape[1] - out_BLNH.shape[1]
            out_BLNH = nn.functional.pad(out_BLNH, (0, 0, 0, 0, 0, pad))
            return DTensor.from_local(out_BLNH, q_BLNH.device_mesh, q_BLNH.placements)
        B, L, N, H = q_BLNH.shape  # B == 1: vLLM's flat token batch
        if self.v_head_dim < H:
            v_BLNH = nn.functional.pad(v_BLNH, (0, H - self.v_head_dim))
        if self.batch_invariant:
            out_LNH, lse_LN = paged_attend(
                q_BLNH[0],
                k_BLNH[0],
                v_BLNH[0],
                self.attn.layer_name,
                self.attn.impl.scale,
                self.window,
                out_transform is not None,
                self.v_head_dim,
            )
            if out_transform is not None:
                out_LNH = out_transform(out_LNH[None], lse_LN[None])[0]
            return out_LNH[None]
        out_LD = self.attn(q_BLNH.reshape(L, N * H), k_BLNH.reshape(L, -1), v_BLNH.reshape(L, -1))
        return out_LD.view(B, L, N, H)[..., : self.v_head_dim]
