"""Continuous placement, in process: the record of the groups trained on (what a resume samples
again), and the token versions a training batch carries. Real runs and the engine's stream:
tests/integration/test_continuous.py.

    .venv/bin/python -m pytest tests/unit/test_continuous.py
"""

import itertools
import pickle

import torch

from torchtitan_rl import platform
from torchtitan_rl.checkpoint import TrainState
from torchtitan_rl.placements.continuous import Cursor, TrainerSide, next_batch
from torchtitan_rl.types import Completions, Rollout, Rollouts, Sample, rollout_batch


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


def test_a_batch_is_the_first_groups_to_finish_or_the_next_ones_admitted():
    # Groups 0-5 admitted, share 2; 3 and 1 finished first, then 0; 2, 4, 5 still running.
    finished, running = [3, 1, 0], [2, 4, 5]
    assert next_batch(finished, running, 2, "completion") == [0, 1]  # groups 3 and 1
    assert next_batch(finished, running, 2, "admission") == [2, 1]  # groups 0 and 1, in order
    assert next_batch(finished[:2], running + [0], 2, "admission") is None  # 0 still running
    assert next_batch(finished[:1], running, 2, "completion") is None
    # A dropped group sampled again keeps its number: the admission order waits for it.
    assert next_batch([5, 4], [1], 2, "admission") is None
    assert next_batch([5, 4, 1], [], 2, "admission") == [2, 1]


def test_the_trainer_counts_token_ages_straddling_samples_and_the_groups_trained():
    """TrainerSide.figures in a gloo world of one: step 5 (the trainer holds version 4)."""
    platform.init_distributed()
    samples = [
        Sample(token_ids=[5, 6, 7], logprobs=[-1.0] * 3, finish_reason="stop", versions=[3, 3, 4]),
        Sample(token_ids=[5, 6], logprobs=[-1.0] * 2, finish_reason="stop", versions=[4, 4]),
        Sample(
            token_ids=[5, 9, 6],
            logprobs=[-1.0, 0.0, -1.0],
            finish_reason="stop",
            sampled_mask=[1, 0, 1],
            versions=[2, -1, 4],  # an episode: the environment's token has no version
        ),
        Sample(token_ids=[], logprobs=[], finish_reason="length", versions=[]),
    ]
    rollouts = Rollouts(
        [None, None], Completions([[1], [1]], [samples[:2], samples[2:]]), torch.zeros(2, 2)
    )
    message = Rollout(
        step=5,
        version=2,
        weights_sha256=None,
        rollouts=rollouts,
        reward_errors=0,
        generate_s=0.0,
        evaluations=[],
        groups=(0, [4, 5]),
        figures={"continuous/generator_busy": 0.5, "continuous/dropped_groups": 1.0},
    )
    state = TrainState(cursors={0: (4, [])}, with_rng=False)
    figures = TrainerSide().figures(5, [message], state, group=None)
    ages = [1, 1, 0, 0, 0, 2, 0]  # step - 1 - version of each sampled token
    assert figures["policy_age/token_mean"] == sum(ages) / len(ages)
    assert figures["policy_age/token_max"] == 2.0
    assert figures["continuous/straddling_share"] == 2 / 4  # the first and the episode
    assert figures["continuous/groups_trained"] == 6.0 and state.cursors[0] == (6, [])
    assert figures["continuous/generator_busy"] == 0.5
    assert figures["continuous/dropped_groups"] == 1.0
