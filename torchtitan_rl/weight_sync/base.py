"""What a weight sync sends, in which buckets, and how a copy is checked: one rule, and one
interface (`Transport`), for every transport: the in-place copy of a colocated run (local.py)
and the broadcast to the generator ranks of a disaggregated one (broadcast.py).

    .venv/bin/python -m pytest tests/unit/test_weight_sync.py

Both sides name and shape their parameters alike (the generator runs the trainer's torchtitan
model class). A sync sends every weight the first time (and whenever the generator dropped
its weights), then only what a step changes: the trained parameters and a LoRA policy's merged
weights, never its frozen ones. Sent tensors go in buckets of about `bucket_mb` in the
generator's dtype, in name order, so that both sides compute the same buckets. Verification
compares SHA-256 digests of the bytes in the generator's dtype.
"""

import hashlib
from dataclasses import dataclass
from typing import Protocol

import torch
from torch.distributed.tensor import DTensor

from torchtitan_rl.errors import StopRun
from torchtitan_rl.trainer.lora import Merged


class WeightSyncError(StopRun):
    """The two sides' parameters differ, or a synced tensor does not match its source."""


@dataclass(frozen=True, slots=True)
class SyncStats:
    bytes: int
    """Bytes sent to the generator's parameters, in its dtype."""
    seconds: float
    gb_per_s: float
    peak_extra_bytes: int
    """Largest total of gather buffers held at once (about one bucket; 0 without gathers)."""
    version: int
    """Policy version after this sync."""
    digest: str | None = None
    """With verification, where the transport checks whole weights across processes: the
    digest (`weights_digest`) of the weights the generators hold after this sync, for them to
    report back (None where every copy was checked in place)."""


class Transport(Protocol):
    """The trainer side of a weight sync, one per placement (`weight_sync.TRANSPORTS`).

    The placement owns the policy version (its TrainState: the version after step s is s) and
    passes it to `send`; the transport carries it to the generators with the weights, so a
    generator's `policy_version` always names the weights it holds.
    """

    verify: bool
    """Whether every copy is checked bit for bit (generator.verify_weight_sync)."""

    def send(self, version: int) -> SyncStats:
        """Write the next sync's weights (`Plan`) into the generators' parameters, in place, and
        tag them with `version`. Collective over the trainer ranks."""

    def stop(self) -> None:
        """The run stops: no weights follow (preempted)."""


def check_same_parameters(trainer: dict, generator: dict) -> None:
    """Raise WeightSyncError naming the first names or shapes the two sides disagree on."""
    only_trainer = sorted(set(trainer) - set(generator))
    only_generator = sorted(set(generator) - set(trainer))
    if only_trainer or only_generator:
        raise WeightSyncError(
            "trainer and generator parameters differ: only in the trainer "
            f"{only_trainer[:5]}, only in the generator {only_generator[:5]}"
        )
    for name, param in trainer.items():
        if tuple(param.shape) != tuple(generator[name].shape):
            raise WeightSyncError(
                f"{name}: trainer shape {tuple(param.shape)} but generator shape "
                f"{tuple(generator[name].shape)}"
            )


def changing(sources: dict, trained_buffers=frozenset()) -> set[str]:
    """The names a step changes: trained parameters, merged LoRA weights, and the
    `trained_buffers` (the MoE routers' bias under training.expert_bias_update_rate:
    `PolicyTrainer.trained_buffers`). A LoRA policy's frozen weights, embeddings and norms
    included, and frozen buffers, are sent by the first sync only."""
    trained = {n for n, s in sources.items() if isinstance(s, Merged) or s.requires_grad}
    return trained | (set(trained_buffers) & set(sources))


def buckets(nbytes: dict[str, int], bucket_bytes: float) -> list[list[str]]:
    """The names in name order, in consecutive buckets of at most `bucket_bytes` (or one
    tensor, if a single one is larger)."""
    groups, current, size = [], [], 0
    for name in sorted(nbytes):
        if current and size + nbytes[name] > bucket_bytes:
            groups.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes[name]
    if current:
        groups.append(current)
    return groups


class Plan:
    """Which buckets each sync sends: all of them first, then those of the changing names."""

    def __init__(self, nbytes: dict[str, int], changed: set[str], bucket_mb: float):
        self.all = buckets(nbytes, bucket_mb * 2**20)
        self.changed = buckets({n: nbytes[n] for n in changed}, bucket_mb * 2**20)
        self.sent_all = False

    def next(self, everything: bool = False) -> list[list[str]]:
        """The buckets of the next sync (`everything`: the receiver needs every weight)."""
        whole = everything or not self.sent_all
        self.sent_all = True
        return self.all if whole else self.changed


def whole(source, dtype: torch.dtype) -> torch.Tensor:
    """A sync source whole, in `dtype`: gathers a DTensor, merges a LoRA weight (collective
    where sharded: every rank of the mesh calls it in the same order)."""
    if isinstance(source, Merged):
        return source.full(dtype)
    if isinstance(source, DTensor):
        return source.to(dtype).full_tensor()
    return source.detach().to(dtype)


def host_bytes(tensor: torch.Tensor) -> bytes:
    """The tensor's raw bytes, copied to the host where it lives on a device."""
    return tensor.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()


def digest(tensor: torch.Tensor) -> bytes:
    """SHA-256 of a tensor's bytes."""
    return hashlib.sha256(host_bytes(tensor)).digest()


def weights_digest(digests: dict[str, bytes]) -> str:
    """One digest of a model's weights from each tensor's (`digest`), in name order: equal
    when every tensor is bit for bit equal."""
    sha = hashlib.sha256()
    for name in sorted(digests):
        sha.update(name.encode() + digests[name])
    return sha.hexdigest()


def verify(name: str, source: torch.Tensor, target: torch.Tensor) -> None:
    """Raise WeightSyncError if `target` is not `source` in `target`'s dtype, bit for bit."""
    if digest(source.to(target.dtype)) != digest(target):
        raise WeightSyncError(f"{name}: generator copy differs from the trainer's")
