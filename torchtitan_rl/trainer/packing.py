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
    """Where a micro-batch's tokens go in its one packed row, and where its scored tokens are:
    index tensors planned on the host (`pack_plan`), moved to the device once (`to`), so the
    device gathers the row from the micro-batch's tokens without a host read."""

    flat_L: torch.Tensor
    """Each packed token's index in the micro-batch's flattened tokens [R * T]; empty when it
    scores nothing (the row is then one token 0: every rank runs as many forwards and
    backwards, for FSDP's collectives)."""
    positions_1L: torch.Tensor
    """Each sequence's positions from 0."""
    docs: Documents
    rows_N: torch.Tensor
    cols_N: torch.Tensor
    """The scored tokens (loss mask > 0, column >= 1) of the micro-batch [R, T]."""
    predictors_N: torch.Tensor
    """The packed position whose hidden state predicts each scored token (its column - 1)."""
    offsets: tuple[int | None, ...] = ()
    """Where each row of the micro-batch starts in the packed row; None for a row it does
    not hold (nothing scored). On the host: it places the rows' images (`vision`)."""

    def to(self, device: torch.device) -> "PackedRow":
        up = platform.upload
        return PackedRow(
            up(self.flat_L, device),
            up(self.positions_1L, device),
            upload_documents(self.docs, device),
            up(self.rows_N, device),
            up(self.cols_N, device),
            up(self.predictors_N, device),
            self.offsets,
        )

    def tokens(self, tokens_RT: torch.Tensor) -> torch.Tensor:
        """The packed row [1, L] of the micro-batch's tokens `tokens_RT` (on the device)."""
        if self.flat_L.numel() == 0:
            return tokens_RT.new_zeros(1, 1)
        return tokens_RT.reshape(-1)[self.flat_L][None]

    def routed(self, routed_RTMK: torch.Tensor | None) -> torch.Tensor | None:
        """The generator's MoE routing of the packed tokens [1, L, M, K] (-1 where unknown), or
        None."""
        if routed_RTMK is None:
            return None
        if self.flat_L.numel() == 0:
            return routed_RTMK.new_full((1, 1, *routed_RTMK.shape[2:]), -1)
        return routed_RTMK.flatten(0, 1)[self.flat_L][None]


def upload_documents(docs: Documents, device: torch.device) -> Documents:
    """Host-built `docs` with their tensors (`cu_seqlens`) on `device` (`platform.upload`)."""
    return Documents(*(platform.upload(d, device) if torch.is_tensor(d) else d for d in docs))


def pack_plan(
    lengths: list[int], width: int, rows_N: torch.Tensor, cols_N: torch.Tensor
) -> PackedRow:
    """The packed row of a micro-batch, on the host: its rows' sequences back to back, each cut
    after its last scored token (`lengths`, from `needed`; rows of `width` tokens), and its
    scored tokens at (`rows_N`, `cols_N`) of the micro-batch, row by row."""
    kept = [r for r, n in enumerate(lengths) if n > 0]
    kept_lengths = [lengths[r] for r in kept]
    if kept:
        flat_L = torch.cat([torch.arange(lengths[r]) + r * width for r in kept])
        positions_L = torch.cat([torch.arange(n) for n in kept_lengths])
    else:
        flat_L = torch.zeros(0, dtype=torch.long)
        positions_L = torch.zeros(1, dtype=torch.long)
    # Where each kept row starts in the packed row.
    sizes = torch.tensor(kept_lengths, dtype=torch.long)
    offsets_R = torch.zeros(len(lengths), dtype=torch.long)
    offsets_R[kept] = sizes.cumsum(0) - sizes
    return PackedRow(
        flat_L=flat_L,
        positions_1L=positions_L[None],
        docs=documents(kept_lengths or [1], torch.device("cpu")),
        rows_N=rows_N,
        cols_N=cols_N,
        # The hidden state at t - 1 predicts token t.
        predictors_N=offsets_R[rows_N] + cols_N - 1,
        offsets=_starts(lengths),
    )


def _starts(lengths: list[int]) -> tuple[int | None, ...]:
    """Where each row starts in the packed row of rows `lengths` long (None: a row it does not
    hold), counted on the host."""
    starts, at = [], 0
    for n in lengths:
        starts.append(at if n > 0 else None)
        at += n
    return tuple(starts)


@dataclass(frozen=True, slots=True)
class MicroBatch:
    """One micro-batch of a step, planned on the host."""

    rows_R: torch.Tensor
    """Its rows of the step's batch, in order."""
    row: PackedRow | None = None
    """Packed: its packed row (None: right-padded rows with full logits)."""

    def to(self, device: torch.device) -> "MicroBatch":
        row = None if self.row is None else self.row.to(device)
        return MicroBatch(platform.upload(self.rows_R, device), row)


def plan(
    mask_BT: torch.Tensor, budget: int, count: int | None = None, pieces: int = 1
) -> list[MicroBatch]:
    """A step's micro-batches from the host loss mask `mask_BT`, every index they need made
    here, once: packed under `budget` tokens (first-fit decreasing by the tokens each row must
    run, then `count` of them: every rank runs as many), or with `budget` 0 `pieces` pieces of
    consecutive rows, right-padded. The mask is read a fixed number of times, however many
    micro-batches there are (tests/unit/test_model.py counts them)."""
    if not budget:
        pieces = min(pieces, mask_BT.shape[0])
        return [MicroBatch(rows) for rows in torch.arange(mask_BT.shape[0]).tensor_split(pieces)]
    lengths = needed(mask_BT)
    groups = first_fit_decreasing(lengths, budget)
    groups = split_to(groups, lengths, max(count or len(groups), 1))
    # The scored tokens (column >= 1: column 0 predicts nothing), row by row, found once.
    scored_BT = mask_BT[:, 1:] > 0
    _, cols_S = scored_BT.nonzero(as_tuple=True)
    cols_S = cols_S + 1
    per_row = scored_BT.sum(1).tolist()
    first = [0]
    for n in per_row:
        first.append(first[-1] + n)
    micro_batches, none = [], [torch.zeros(0, dtype=torch.long)]
    for group in groups:
        # This micro-batch's scored tokens: its rows' runs of cols_S, in its order.
        picked_N = torch.cat([torch.arange(first[b], first[b + 1]) for b in group] or none)
        rows_N = torch.cat(
            [torch.full((per_row[b],), r, dtype=torch.long) for r, b in enumerate(group)] or none
        )
        row = pack_plan([lengths[b] for b in group], mask_BT.shape[1], rows_N, cols_S[picked_N])
        micro_batches.append(MicroBatch(torch.tensor(group, dtype=torch.long), row))
    return micro_batches


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


def padded_scale(mask_BT: torch.Tensor, group, tp_degree: int) -> LossScale:
    """The step's global counts from the host loss mask of this rank's right-padded rows:
    scored tokens, and sequences with one (filtered groups have none), summed over `group`,
    whose TP ranks (`tp_degree` each) hold the same rows."""
    mask_BT = mask_BT.cpu()
    counts = torch.stack([mask_BT.sum(), (mask_BT.sum(1) > 0).sum()]).double()
    platform.all_reduce_host(counts, group=group)
    tokens, sequences = (counts / tp_degree).tolist()
    return LossScale(tokens=int(tokens), sequences=int(sequences))


def deal(batch: RolloutBatch, budget: int, group, device: torch.device) -> Dealt:
    """The rows of `group`'s ranks (data-parallel) redealt so that their token loads balance
    (`rebalance`: few rows move, none when they already balance), and the number of packed
    micro-batches of at most `budget` tokens every rank runs. One gather of row lengths plans
    it on every rank alike; rows travel only when some move. Runs on the host: the dealt
    batch's rows are host tensors (moved to `device` by the caller, once); `back` reads its
    tensors from the device once each."""
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
        dealt = RolloutBatch.cat(pieces)
    else:
        dealt = batch.rows(torch.zeros(0, dtype=torch.long))

    def back(*tensors_BT: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Tensors [B', T'] of the dealt rows -> this rank's own rows [B, T] (on `device`)."""
        tensors_BT = tuple(map(torch.Tensor.cpu, tensors_BT))  # one read of the device each
        outs = [torch.zeros(batch.tokens_BT.shape) for _ in tensors_BT]
        borrowed = [(k, r, i) for k, (r, i) in enumerate(shares[me]) if r != me]
        returned = platform.all_gather_objects(
            [((r, i), [t[k] for t in tensors_BT]) for k, r, i in borrowed], group
        )
        for k, (r, i) in enumerate(shares[me]):
            if r == me:
                for out, tensor in zip(outs, tensors_BT, strict=True):
                    _copy_row(out[i], tensor[k])
        for (r, i), values in (item for parcel in returned for item in parcel):
            if r == me:
                for out, value in zip(outs, values, strict=True):
                    _copy_row(out[i], value)
        return tuple(platform.upload(out, device) for out in outs)

    return Dealt(dealt, count, scale, back)


def _copy_row(out_T: torch.Tensor, value_T: torch.Tensor) -> None:
    width = min(out_T.shape[0], value_T.shape[0])
    out_T[:width] = value_T[:width]
