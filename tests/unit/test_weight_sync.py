"""WeightSync's copy logic on plain tensors: mismatches named, dtype casts, bounded buckets,
verification. With real trainers and engines: tests/integration/test_weight_sync.py.

    .venv/bin/python -m pytest tests/unit/test_weight_sync.py
"""

import queue
import time

import pytest
import torch
import torch.nn as nn

import torchtitan_rl.weight_sync.local
from torchtitan_rl.weight_sync import TRANSPORTS, LocalTransport, WeightSync, WeightSyncError
from torchtitan_rl.weight_sync.broadcast import STOP, BroadcastReceiver, StagedReceiver


def params(**shapes) -> dict[str, nn.Parameter]:
    g = torch.Generator().manual_seed(len(shapes))
    return {k: nn.Parameter(torch.randn(*s, generator=g)) for k, s in shapes.items()}


class FakeGenerator:
    """Stands in for LocalGenerator's weights and refresh hook in unit tests of the copy alone."""

    policy_version = 0
    refreshed = 0
    weights_dropped = False

    def __init__(self, weights: dict):
        self._weights = weights

    def weights(self) -> dict:
        return self._weights

    def refresh_after_weight_update(self):
        self.refreshed += 1


class FakeTrainer:
    """Stands in for PolicyTrainer's sync sources (and its trained buffers: none)."""

    trained_buffers: set[str] = set()

    def __init__(self, sources: dict):
        self.sources = sources

    def sync_sources(self) -> dict:
        return self.sources


def test_mismatching_parameter_sets_are_named():
    with pytest.raises(WeightSyncError, match=r"only in the trainer \['b'\], only in the gen"):
        WeightSync(params(a=(2,), b=(3,)), params(a=(2,), c=(3,)))
    with pytest.raises(WeightSyncError, match=r"a: trainer shape \(2, 3\) but generator shape"):
        WeightSync(params(a=(2, 3)), params(a=(3, 2)))


def test_a_buffer_goes_with_every_sync_only_when_the_trainer_trains_it():
    """A frozen buffer (the MoE routers' bias by default) is sent by the first sync only;
    under training.expert_bias_update_rate (`trained_buffers`) by every sync."""
    source = params(w=(4, 4))
    source["bias"] = torch.randn(8)
    target = {k: torch.zeros_like(v) for k, v in source.items()}
    for trained, expected in ((set(), {"w"}), ({"bias"}, {"w", "bias"})):
        sync = WeightSync(
            source, {k: nn.Parameter(v.clone()) for k, v in target.items()}, trained_buffers=trained
        )
        first, later = sync.plan.next(), sync.plan.next()
        assert {n for names in first for n in names} == {"w", "bias"}
        assert {n for names in later for n in names} == expected


def test_copy_casts_to_the_generator_dtype_and_buckets_bound_memory():
    source = params(a=(64, 64), b=(64, 64), c=(256, 64), d=(8,))
    target = {k: nn.Parameter(torch.zeros_like(v, dtype=torch.bfloat16)) for k, v in source.items()}
    generator = FakeGenerator(target)
    sync = LocalTransport(FakeTrainer(source), generator, bucket_mb=32 * 1024 / 2**20, verify=True)
    # bf16 bytes: a, b = 8 KiB each, c = 32 KiB (alone), d = 16 B.
    assert [[name for name, _, _ in bucket] for bucket in sync.copier.buckets] == [
        ["a", "b"],
        ["c"],
        ["d"],
    ]
    stats = sync.send(version=5)
    for k in source:
        assert torch.equal(target[k], source[k].detach().to(torch.bfloat16))
    assert stats.bytes == sum(t.numel() * 2 for t in target.values())
    assert stats.peak_extra_bytes == 0  # plain tensors: copied without gathering
    # The transport carries the version it is given (the placement's TrainState owns it).
    assert generator.refreshed == 1 and generator.policy_version == stats.version == 5


def test_verification_catches_a_bad_copy(monkeypatch):
    source, target = params(a=(4, 4), b=(4,)), params(a=(4, 4), b=(4,))

    def corrupting_write(dest, full):
        dest.copy_(full)
        if dest.shape == (4,):
            dest[0] += 1.0

    monkeypatch.setattr(torchtitan_rl.weight_sync.local, "_write", corrupting_write)
    with pytest.raises(WeightSyncError, match="b: generator copy differs from the trainer's"):
        sync = LocalTransport(FakeTrainer(source), FakeGenerator(target), bucket_mb=64, verify=True)
        sync.send(version=1)


def test_every_placement_has_a_transport_with_the_interface():
    """TRANSPORTS names one transport per generator.placement, each with Transport's methods
    and a `build(config, trainer, peer)` (a new transport is one file and one entry here)."""
    from typing import get_args

    from torchtitan_rl.config.generator import GeneratorSection

    placements = get_args(GeneratorSection.__annotations__["placement"])
    assert sorted(TRANSPORTS) == sorted(placements)
    for cls in TRANSPORTS.values():
        for method in ("send", "stop", "build"):
            assert callable(getattr(cls, method)), (cls, method)


class QueuedReceiver(BroadcastReceiver):
    """A BroadcastReceiver whose broadcasts are a queue: `_buckets` and `_flat` block until the
    test puts a header or a bucket (the real gloo broadcast under StagedReceiver:
    tests/integration/test_continuous.py, exact at k = 0)."""

    def __init__(self, generator):
        super().__init__(generator, leader=0, group=None, bucket_mb=64)
        self.queue: queue.Queue = queue.Queue()
        self.flats_made = 0

    def next_sync(self, params):
        version = self.queue.get(timeout=30)
        return None if version == STOP else (version, [sorted(params)])

    def receive_bucket(self, names, params, into=None):
        value = self.queue.get(timeout=30)
        flat = into.get(tuple(names)) if into is not None else None
        if flat is None:
            flat = torch.empty(sum(params[n].numel() for n in names))
            self.flats_made += 1
            if into is not None:
                into[tuple(names)] = flat
        flat.fill_(value)
        return flat


def test_staged_weights_arrive_while_the_engine_runs_and_land_only_when_taken():
    weights = {"a": torch.zeros(3), "b": torch.zeros(2, 2)}
    generator = FakeGenerator(weights)
    receiver = QueuedReceiver(generator)
    staged = StagedReceiver(receiver)

    assert not staged.ready()  # the thread waits for the first header
    receiver.queue.put(1)
    receiver.queue.put(1.0)
    assert staged.receive() is True
    assert generator.policy_version == 1 and generator.refreshed == 1
    assert all(bool((w == 1.0).all()) for w in weights.values())

    # Version 2 arrives whole while "the engine generates": the weights it uses stay version
    # 1's until it is taken between engine steps.
    receiver.queue.put(2)
    receiver.queue.put(2.0)
    deadline = time.monotonic() + 30
    while not staged.ready():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert generator.policy_version == 1 and all(bool((w == 1.0).all()) for w in weights.values())
    assert staged.receive() is True
    assert generator.policy_version == 2 and generator.refreshed == 2
    assert all(bool((w == 2.0).all()) for w in weights.values())
    assert receiver.flats_made == 1  # the second copy is one buffer, reused

    receiver.queue.put(STOP)  # the trainers stop the run
    assert staged.receive() is False and generator.policy_version == 2


def test_a_failed_staged_receive_raises_on_the_generators_loop():
    receiver = QueuedReceiver(FakeGenerator({"a": torch.zeros(1)}))
    staged = StagedReceiver(receiver)
    receiver.queue.put(1)
    receiver.queue.put("not a number")  # fill_ raises in the thread
    with pytest.raises(TypeError):
        staged.receive()
