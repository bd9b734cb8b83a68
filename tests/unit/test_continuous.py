"""Continuous placement, in process: the record of the groups trained on (what a resume samples
again), and the token versions a training batch carries. Real runs and the engine's stream:
tests/integration/test_continuous.py.

    .venv/bin/python -m pytest tests/unit/test_continuous.py
"""

import itertools
import pickle

import torch

from torchtitan_rl.checkpoint import TrainState
from torchtitan_rl.placements.continuous import Cursor
from torchtitan_rl.types import Sample, rollout_batch


def test_a_cursor_resumes_every_group_not_trained_on_in_order_each_once(monkeypatch):
    cursor = Cursor()
    # Groups finish out of order: 0-3 and 6, 7 trained on; 4 and 5 were in flight.
    cursor.add([1, 0, 3, 2])
    cursor.add([7, 6])
    assert (cursor.below, cursor.above) == (4, [6, 7])
    assert list(itertools.islice(cursor.untaken(), 4)) == [4, 5, 8, 9]
    cursor.add([5, 4])
    assert (cursor.below, cursor.above) == (8, [])
    # A checkpoint holds the cursors by generator shard; a resume finds its own (or starts).
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 0)  # a trainer rank's state
    state = TrainState(cursors={0: (cursor.below, cursor.above), 1: (2, [5])}, with_rng=False)
    restored = TrainState(cursors={}, with_rng=False)
    restored.load_state_dict(state.state_dict())
    assert Cursor.of(restored.cursors, 1) == Cursor(2, [5])
    assert Cursor.of(restored.cursors, 3) == Cursor(0, [])
    assert isinstance(state.state_dict()["cursors"], bytes)  # one DCP leaf
    assert (
        "cursors" not in TrainState(with_rng=False).state_dict()
    )  # the other placements' is unchanged
    assert pickle.loads(state.state_dict()["cursors"])[1] == (2, [5])


def test_a_batch_carries_each_token_version_and_none_without_them():
    streamed = Sample(
        token_ids=[5, 6, 7], logprobs=[-1.0] * 3, finish_reason="stop", versions=[3, 3, 4]
    )
    episode = Sample(
        token_ids=[5, 9, 9, 6],
        logprobs=[-1.0, 0.0, 0.0, -1.0],
        finish_reason="stop",
        sampled_mask=[1, 0, 0, 1],
        versions=[4, -1, -1, 5],
    )
    batch = rollout_batch([[1, 2]], [[streamed, episode]], torch.zeros(1, 2), pad_id=0)
    assert batch.versions_BT.tolist() == [[-1, -1, 3, 3, 4, -1], [-1, -1, 4, -1, -1, 5]]
    plain = Sample(token_ids=[5], logprobs=[-1.0], finish_reason="stop")
    assert rollout_batch([[1]], [[plain]], torch.zeros(1, 1), pad_id=0).versions_BT is None
