"""Packing a rank's sequences into micro-batches of at most `training.micro_batch_tokens`.

    .venv/bin/python -m pytest tests/unit/test_packing.py

A micro-batch becomes one packed row (PolicyTrainer): its sequences back to back, each with
positions from 0 and document-causal attention, so a sequence sees what the generator saw and
never its neighbours. Only the tokens up to a sequence's last scored one are run (`needed`).
"""

import torch


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
