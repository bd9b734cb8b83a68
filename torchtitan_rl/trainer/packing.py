"""Packing a rank's sequences into micro-batches of at most `training.micro_batch_tokens`.

    .venv/bin/python -m pytest tests/unit/test_packing.py

A micro-batch becomes one packed row (PolicyTrainer): its sequences back to back, each with
positions from 0 and document-causal attention, so a sequence sees what the generator saw and
never its neighbours. Only the tokens up to a sequence's last scored one are run (`needed`).
Before packing, the data-parallel ranks redeal their rows so that their token loads balance
(`deal`). Shapes: B rows, T tokens, L tokens of a packed row, N scored tokens.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from torchtitan_rl import platform
from torchtitan_rl.trainer.attention import Documents, documents
from torchtitan_rl.types import LossScale, RolloutBatch


def needed(mask_BT: torch.Tensor) -> list[int]:
    """Tokens each row must run: through its last scored (mask > 0) token; 0 if none. Later
    tokens cannot change an earlier token's logprob (causal)."""
    scored_BT = mask_BT > 0
    width = mask_BT.shape[1]
    last_B = width - 1 - scored_BT.flip(1).int().argmax(1)
    return torch.where(scored_BT.any(1), last_B + 1, 0).tolist()


def first_fit_decreasing(lengths: list[int], budget: int) -> list[list[int]]:
    """Row indices grouped so that each group's lengths sum to at most `budget`: longest first,
    each into the first group with room (ties by index, so every rank and every run packs the
    same way). Rows of length 0 are left out; a row longer than `budget` is an error."""
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    room: list[int] = []
    for i in order:
        if lengths[i] > budget:
            raise ValueError(f"a sequence of {lengths[i]} tokens exceeds the budget of {budget}")
        slot = next((g for g, free in enumerate(room) if free >= lengths[i]), None)
        if slot is None:
            groups.append([])
            room.append(budget)
            slot = len(groups) - 1
        groups[slot].append(i)
        room[slot] -= lengths[i]
    return groups


def split_to(groups: list[list[int]], lengths: list[int], count: int) -> list[list[int]]:
    """`groups` made `count` groups: the one with the most tokens among those of two or more rows
    is halved (alternate rows, so both halves keep long and short ones) until there are enough;
    if every group is one row, empty groups follow (a micro-batch that scores nothing, so
    that every rank runs as many forwards: FSDP's gathers are collective)."""
    groups = [list(g) for g in groups]
    while len(groups) < count:
        splittable = [g for g in range(len(groups)) if len(groups[g]) > 1]
        if not splittable:
            groups.append([])
            continue
        largest = max(splittable, key=lambda g: sum(lengths[i] for i in groups[g]))
        group = groups.pop(largest)
        groups[largest:largest] = [group[0::2], group[1::2]]
    return groups


def rebalance(lengths: list[list[int]], tolerance: float = 0.02) -> list[list[tuple[int, int]]]:
    """Rows of `lengths[r]` (rank r's rows' token counts) redealt so that the ranks' token sums
    balance, moving few rows: while the most loaded rank exceeds the least loaded by more than
    `tolerance` of its load, it hands over the row whose length is nearest half the gap (each
    move narrows that gap). Returns each rank's rows as (owner rank, row) pairs, its own
    first, in order. Deterministic (ties by rank, then row): every rank computes the same."""
    shares = [[(r, i) for i in range(len(rows))] for r, rows in enumerate(lengths)]
    loads = [sum(rows) for rows in lengths]
    ranks = range(len(lengths))
    while True:
        hi = max(ranks, key=lambda r: (loads[r], -r))
        lo = min(ranks, key=lambda r: (loads[r], r))
        gap = loads[hi] - loads[lo]
        if gap <= tolerance * loads[hi]:
            return shares
        # 0 < n < gap: moving n makes this pair's gap |gap - 2n| < gap.
        candidates = [
            (abs(gap - 2 * lengths[r][i]), k)
            for k, (r, i) in enumerate(shares[hi])
            if 0 < lengths[r][i] < gap
        ]
        if not candidates:
            return shares
        _, k = min(candidates)
        r, i = shares[hi].pop(k)
        shares[lo].append((r, i))
        loads[hi] -= lengths[r][i]
        loads[lo] += lengths[r][i]


@dataclass(frozen=True, slots=True)
class PackedRow:
    """A micro-batch as one packed row, and where its scored tokens are."""

    tokens_1L: torch.Tensor
    positions_1L: torch.Tensor
    """Each sequence's positions from 0."""
    docs: Documents
    rows_N: torch.Tensor
    cols_N: torch.Tensor
    """The scored tokens (loss mask > 0, column >= 1) of the micro-batch [B, T]."""
    predictors_N: torch.Tensor
    """The packed position whose hidden state predicts each scored token (its column - 1)."""
    targets_N: torch.Tensor
    """The scored tokens' ids."""
    routed_1LMK: torch.Tensor | None = None
    """The generator's MoE routing of the packed tokens (`RolloutBatch.routed_experts_BTMK`,
    packed the same way; -1 where unknown), or None."""


def pack_row(micro: RolloutBatch, device: torch.device) -> PackedRow:
    """`micro`'s sequences back to back, each cut after its last scored token; with nothing
    scored, one token (every rank runs as many forwards and backwards: FSDP's collectives)."""
    tokens_BT, mask_BT = micro.tokens_BT, micro.loss_mask_BT
    lengths = needed(mask_BT)
    kept = [b for b, n in enumerate(lengths) if n > 0]
    kept_lengths = [lengths[b] for b in kept]
    routed_BTMK = micro.routed_experts_BTMK
    routed_LMK = None
    if kept:
        tokens_L = torch.cat([tokens_BT[b, : lengths[b]] for b in kept])
        if routed_BTMK is not None:
            routed_LMK = torch.cat([routed_BTMK[b, : lengths[b]] for b in kept])
        positions_L = torch.cat([torch.arange(n) for n in kept_lengths]).to(device)
    else:
        tokens_L = torch.zeros(1, dtype=torch.long, device=device)
        positions_L = torch.zeros(1, dtype=torch.long, device=device)
    # Where each kept row starts in the packed row.
    sizes = torch.tensor(kept_lengths, dtype=torch.long)
    offsets_B = torch.zeros(len(lengths), dtype=torch.long)
    offsets_B[kept] = sizes.cumsum(0) - sizes
    offsets_B = offsets_B.to(device)
    # Column 0 predicts nothing; the hidden state at t - 1 predicts token t.
    rows_N, cols_N = (mask_BT[:, 1:] > 0).nonzero(as_tuple=True)
    cols_N = cols_N + 1
    return PackedRow(
        tokens_1L=tokens_L[None],
        positions_1L=positions_L[None],
        docs=documents(kept_lengths or [1], device),
        rows_N=rows_N,
        cols_N=cols_N,
        predictors_N=offsets_B[rows_N] + cols_N - 1,
        targets_N=tokens_BT[rows_N, cols_N],
        routed_1LMK=None if routed_LMK is None else routed_LMK.to(device)[None],
    )


@dataclass(frozen=True, slots=True)
class Dealt:
    """A rank's rows after `deal`."""

    batch: RolloutBatch
    count: int | None
    """Micro-batches every rank runs (None: padded, `training.micro_batches`)."""
    scale: LossScale | None
    """The step's global counts (None: padded, where optimizer_step all-reduces them)."""
    back: Callable[..., tuple[torch.Tensor, ...]]
    """Tensors [B', T'] of `batch`'s rows -> the rank's own rows [B, T] (a collective when
    rows moved)."""


def all_lengths(mask_BT: torch.Tensor, group) -> tuple[list[list[int]], int, LossScale]:
    """Every rank of `group`'s row lengths (`needed`), this rank's index among them, and the
    global counts of the step (scored tokens, sequences with one): two small all-reduces,
    cheaper than an object gather. `group` None: this rank alone."""
    lengths = needed(mask_BT)
    scored_B = mask_BT.sum(1).round().long().cpu()
    ranks, me = (1, 0) if group is None else (dist.get_world_size(group), dist.get_rank(group))
    counts = torch.zeros(ranks, dtype=torch.int64)
    counts[me] = len(lengths)
    if group is not None:
        platform.all_reduce_host(counts, group=group)
    table = torch.zeros(ranks, int(counts.max()), 2, dtype=torch.int64)
    table[me, : len(lengths), 0] = torch.tensor(lengths, dtype=torch.int64)
    table[me, : len(lengths), 1] = scored_B
    if group is not None:
        platform.all_reduce_host(table, group=group)
    scale = LossScale(tokens=int(table[..., 1].sum()), sequences=int((table[..., 1] > 0).sum()))
    return [table[r, : int(counts[r]), 0].tolist() for r in range(ranks)], me, scale


def deal(batch: RolloutBatch, budget: int, group, device: torch.device) -> Dealt:
    """The rows of `group`'s ranks (data-parallel) redealt so that their token loads balance
    (`rebalance`: few rows move, none when they already balance), and the number of packed
    micro-batches of at most `budget` tokens every rank runs. One gather of row lengths plans
    it on every rank alike; rows travel only when some move."""
    everyone, me, scale = all_lengths(batch.loss_mask_BT, group)
    shares = rebalance(everyone)
    count = max(
        len(first_fit_decreasing([everyone[r][i] for r, i in share], budget)) for share in shares
    )
    if all(r == rank for rank, share in enumerate(shares) for r, _ in share):
        return Dealt(batch, count, scale, lambda *tensors_BT: tensors_BT)
    # Every rank sends the rows it gives away, with their indices.
    host = torch.device("cpu")
    given = [i for rank, share in enumerate(shares) for r, i in share if r == me != rank]
    sent = batch.rows(torch.tensor(given, dtype=torch.long)).to(host)
    parcels = platform.all_gather_objects((given, sent), group)
    pieces = [
        batch.rows(torch.tensor([i])).to(host)
        if r == me
        else parcels[r][1].rows(torch.tensor([parcels[r][0].index(i)]))
        for r, i in shares[me]
    ]
    if pieces:
        dealt = RolloutBatch.cat(pieces).to(device)
    else:
        dealt = batch.rows(torch.zeros(0, dtype=torch.long))

    def back(*tensors_BT: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Tensors [B', T'] of the dealt rows -> this rank's own rows [B, T]."""
        outs = [torch.zeros(batch.tokens_BT.shape, device=device) for _ in tensors_BT]
        borrowed = [(k, r, i) for k, (r, i) in enumerate(shares[me]) if r != me]
        returned = platform.all_gather_objects(
            [((r, i), [t[k].to(host) for t in tensors_BT]) for k, r, i in borrowed], group
        )
        for k, (r, i) in enumerate(shares[me]):
            if r == me:
                for out, tensor in zip(outs, tensors_BT, strict=True):
                    _copy_row(out[i], tensor[k])
        for (r, i), values in (item for parcel in returned for item in parcel):
            if r == me:
                for out, value in zip(outs, values, strict=True):
                    _copy_row(out[i], value.to(device))
        return tuple(outs)

    return Dealt(dealt, count, scale, back)


def _copy_row(out_T: torch.Tensor, value_T: torch.Tensor) -> None:
    width = min(out_T.shape[0], value_T.shape[0])
    out_T[:width] = value_T[:width]
