"""WeightSync's copy logic on plain tensors: mismatches named, dtype casts, bounded buckets,
verification. With real trainers and engines: tests/integration/test_weight_sync.py.

    .venv/bin/python -m pytest tests/unit/test_weight_sync.py
"""

import pytest
import torch
import torch.nn as nn
from helpers.launch import run_dist

import torchtitan_rl.weight_sync.local
from torchtitan_rl.weight_sync import TRANSPORTS, LocalTransport, WeightSync, WeightSyncError


def launch(tmp_path_factory, nproc: int) -> list[dict]:
    out = tmp_path_factory.mktemp(f"weight_sync_w{nproc}")
    run_dist("weight_sync_run.py", str(out), nproc=nproc)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(max(nproc, 1))]


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
    """Stands in for PolicyTrainer's sync sources."""

    def __init__(self, sources: dict):
        self.sources = sources

    def sync_sources(self) -> dict:
        return self.sources


def test_mismatching_parameter_sets_are_named():
    with pytest.raises(WeightSyncError, match=r"only in the trainer \['b'\], only in the gen"):
        WeightSync(params(a=(2,), b=(3,)), params(a=(2,), c=(3,)))
    with pytest.raises(WeightSyncError, match=r"a: trainer shape \(2, 3\) but generator shape"):
        WeightSync(params(a=(2, 3)), params(a=(3, 2)))


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
