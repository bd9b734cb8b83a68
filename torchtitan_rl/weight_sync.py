"""WeightSync: the trainer's sharded parameters copied in place into the generator, every step.

    .venv/bin/python -m pytest tests/test_weight_sync.py

The generator runs the trainer's torchtitan model class, so both sides name and shape their
parameters alike (fused QKV included) and a sync is: for each bucket of parameters, gather the
trainer's DTensor shards into full tensors (a collective: every rank runs the same buckets in
the same order), `copy_` them into the generator's parameters (casting to its dtype), drop the
gathered tensors. No file, no `load_weights`, no full state dict: peak extra memory is about one
bucket. Then the generator refreshes what derives from its weights (packed GEMM copies, the
prefix cache: measured, prompts of >= 128 tokens otherwise reuse KV from the old weights) and
the policy version goes up on both sides.
"""

import time
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor


class WeightSyncError(RuntimeError):
    """The two sides' parameters differ, or a synced tensor does not match its source."""


@dataclass(frozen=True, slots=True)
class SyncStats:
    bytes: int
    """Bytes written into generator parameters."""
    seconds: float
    gb_per_s: float
    peak_extra_bytes: int
    """Largest total of gathered full tensors held at once (one bucket)."""
    version: int
    """Policy version after this sync."""


def _full(param: torch.Tensor) -> torch.Tensor:
    return param.full_tensor() if isinstance(param, DTensor) else param.detach()


def _write(target: torch.Tensor, full: torch.Tensor) -> None:
    target.copy_(full)  # casts to the generator's dtype


def _checksum(tensor: torch.Tensor) -> tuple[float, float]:
    # Position-weighted so swapped elements are caught too, not only changed sums.
    flat = tensor.detach().reshape(-1).double()
    weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64) / flat.numel()
    return float(flat.sum()), float((flat * weights).sum())


class WeightSync:
    """Copies trainer parameters into generator parameters of the same torchtitan FQN.

    `trainer_params` and `generator_params` map FQN -> parameter (tied weights once each).
    Mismatching names or shapes are a WeightSyncError naming them, raised here, once.
    """

    def __init__(
        self,
        trainer_params: dict[str, nn.Parameter],
        generator_params: dict[str, nn.Parameter],
        *,
        bucket_mb: float = 64.0,
        verify: bool = False,
    ):
        only_trainer = sorted(set(trainer_params) - set(generator_params))
        only_generator = sorted(set(generator_params) - set(trainer_params))
        if only_trainer or only_generator:
            raise WeightSyncError(
                "trainer and generator parameters differ: only in the trainer "
                f"{only_trainer[:5]}, only in the generator {only_generator[:5]}"
            )
        for name, param in trainer_params.items():
            if tuple(param.shape) != tuple(generator_params[name].shape):
                raise WeightSyncError(
                    f"{name}: trainer shape {tuple(param.shape)} but generator shape "
                    f"{tuple(generator_params[name].shape)}"
                )
        self.verify = verify
        self.version = 0
        self.buckets = self._buckets(trainer_params, generator_params, bucket_mb * 2**20)

    @classmethod
    def between(cls, trainer, generator, *, bucket_mb: float, verify: bool) -> "WeightSync":
        """The sync from a PolicyTrainer to a Generator (their live parameters)."""
        return cls(
            trainer.named_parameters(),
            generator.named_parameters(),
            bucket_mb=bucket_mb,
            verify=verify,
        )

    @staticmethod
    def _buckets(trainer_params, generator_params, bucket_bytes: float):
        """Consecutive (name, source, target) groups of at most `bucket_bytes` each (or one
        parameter, if a single one is larger)."""
        buckets, current, size = [], [], 0
        for name, source in trainer_params.items():
            target = generator_params[name]
            nbytes = target.numel() * target.element_size()
            if current and size + nbytes > bucket_bytes:
                buckets.append(current)
                current, size = [], 0
            current.append((name, source, target))
            size += nbytes
        if current:
            buckets.append(current)
        return buckets

    @torch.no_grad()
    def copy(self) -> tuple[int, int]:
        """Copy every parameter, bucket by bucket; returns (bytes written, peak extra bytes)."""
        written, peak = 0, 0
        for bucket in self.buckets:
            gathered = [_full(source) for _, source, _ in bucket]
            peak = max(peak, sum(t.numel() * t.element_size() for t in gathered))
            for (name, _, target), full in zip(bucket, gathered, strict=True):
                _write(target, full)
                written += target.numel() * target.element_size()
                if self.verify and _checksum(full.to(target.dtype)) != _checksum(target):
                    raise WeightSyncError(f"{name}: generator copy differs from the trainer's")
            del gathered
        return written, peak

    def sync(self, trainer, generator) -> SyncStats:
        """Copy the weights, refresh the generator, bump the policy version on both sides."""
        start = time.perf_counter()
        written, peak = self.copy()
        generator.refresh_after_weight_update()
        seconds = time.perf_counter() - start
        self.version += 1
        trainer.policy_version = generator.policy_version = self.version
        return SyncStats(
            bytes=written,
            seconds=seconds,
            gb_per_s=written / seconds / 1e9,
            peak_extra_bytes=peak,
            version=self.version,
        )
