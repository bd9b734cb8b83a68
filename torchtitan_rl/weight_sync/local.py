"""The colocated transport (LocalTransport): the trainer's sharded parameters copied in place
into the generator of the same process, every step, by a WeightSync (what is sent, and the
check: base.py).

    .venv/bin/python -m pytest tests/*/test_weight_sync.py

The generator runs the trainer's torchtitan model class, so both sides name and shape their
parameters alike (fused QKV included) and a sync is: for each bucket of parameters, all-gather
the trainer's FSDP shards with one collective (every rank runs the same buckets in the same
order) and `copy_` each rank's rows straight into the generator's parameters, casting to its
dtype. No file, no `load_weights`, no full state dict: peak extra memory is about one bucket,
and nothing is gathered on a one-rank mesh. Then the generator refreshes what derives from its
weights (packed GEMM copies, the prefix cache: measured, prompts of >= 128 tokens otherwise
reuse KV from the old weights) and takes the policy version its weights now are.
"""

import math
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from torchtitan_rl import platform
from torchtitan_rl.trainer.lora import Merged
from torchtitan_rl.weight_sync.base import (
    Plan,
    SyncStats,
    changing,
    check_same_parameters,
    verify,
)


def _write(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy the whole tensor `full` into `target`, cast to its dtype; a generator sharded with
    tensor parallelism (a DTensor target) keeps its own shard of it."""
    if isinstance(target, DTensor):
        target.to_local().copy_(full[shard_of(target)])
    else:
        target.copy_(full)


def shard_of(target: DTensor) -> tuple[slice, ...]:
    """The index of `target`'s local shard in its whole tensor."""
    shape, offset = compute_local_shape_and_global_offset(
        target.shape, target.device_mesh, target.placements
    )
    return tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


def _check(name: str, full: torch.Tensor, target: torch.Tensor) -> None:
    """`verify` of what `target` holds of `full` (every TP rank checks its own shard)."""
    if isinstance(target, DTensor):
        verify(name, full[shard_of(target)], target.to_local())
    else:
        verify(name, full, target)


def _placed(source):
    """The tensor whose placement a source has (a merged LoRA weight: its base weight's)."""
    return source.weight if isinstance(source, Merged) else source


def _fsdp_sharded(bucket) -> bool:
    """Whether every source is an FSDP shard (Shard(0)) on one 1-D mesh, and every target has
    one dtype."""
    first_source, first_target = _placed(bucket[0][1]), bucket[0][2]
    return all(
        isinstance(_placed(source), DTensor)
        and _placed(source).placements == (Shard(0),)
        and _placed(source).device_mesh is first_source.device_mesh
        and first_source.device_mesh.ndim == 1
        and target.dtype == first_target.dtype
        for _, source, target in bucket
    )


def _gathers_fsdp(bucket) -> bool:
    """Whether the bucket is FSDP shards over more than one rank: one all-gather serves it."""
    return _fsdp_sharded(bucket) and _placed(bucket[0][1]).device_mesh.size() > 1


def _copy_bucket(bucket, check: bool, shared: "platform.HostSharedGather | None") -> int:
    """Copy one bucket of (name, source, target); returns the extra bytes it held at once."""
    if _gathers_fsdp(bucket):
        return _copy_fsdp_bucket(bucket, check, shared)
    peak = 0
    for name, source, target in bucket:
        if isinstance(source, Merged):
            full = source.full(target.dtype)  # merged whole, in the generator's dtype
            peak += full.numel() * full.element_size()
        elif isinstance(source, DTensor) and source.device_mesh.size() > 1:
            # HSDP / TP layouts: DTensor gathers them, in the generator's dtype.
            full = source.to(target.dtype).full_tensor()
            peak += full.numel() * full.element_size()
        else:
            full = source.to_local() if isinstance(source, DTensor) else source.detach()
        _write(target, full)
        if check:
            _check(name, full, target)
    return peak


def _gather_layout(bucket) -> tuple[list[tuple[int, int, int]], int]:
    """Where each parameter's shard sits in a rank's gather buffer: per parameter (offset,
    rows per rank, row numel), and the buffer's numel."""
    world = _placed(bucket[0][1]).device_mesh.size()
    layout, total = [], 0
    for _, source, _ in bucket:
        rows_per_rank = math.ceil(source.shape[0] / world)
        row_numel = math.prod(source.shape[1:])
        layout.append((total, rows_per_rank, row_numel))
        total += rows_per_rank * row_numel
    return layout, total


def _copy_fsdp_bucket(bucket, check: bool, shared: "platform.HostSharedGather | None") -> int:
    """One all-gather for the whole bucket, each rank's rows written straight into place.

    FSDP2 shards dim 0 like torch.chunk: rank r holds rows [r*c, min((r+1)*c, n)) with
    c = ceil(n / world). Every rank sends a buffer padded to the same size, in the generator's
    dtype: a bf16 generator moves half the bytes of the fp32 master weights. With `shared`
    (ranks on one host, CPU) each rank writes its shards straight into its slot of shared
    memory and reads the others' from there: no send buffer, no socket.
    """
    mesh = _placed(bucket[0][1]).device_mesh
    world = mesh.size()
    layout, total = _gather_layout(bucket)
    dtype, device = bucket[0][2].dtype, _placed(bucket[0][1]).device
    if shared is not None:
        send = shared.my_slot(total, dtype)
    else:
        send = torch.zeros(total, dtype=dtype, device=device)
    for (offset, _, _), (_, source, _) in zip(layout, bucket, strict=True):
        # A merged LoRA weight: this rank's rows, merged in the generator's dtype.
        local = source.local(dtype) if isinstance(source, Merged) else source.to_local()
        local = local.reshape(-1)
        send[offset : offset + local.numel()].copy_(local)  # cast to the generator's dtype
    if shared is not None:
        received = shared.gather(total, dtype)
        held = shared.buffer.numel()  # held for the run: every rank's slot, once per host
    else:
        received = torch.empty(world * total, dtype=dtype, device=device)
        dist.all_gather_single(received, send, group=mesh.get_group())
        received = received.view(world, total)
        held = (send.numel() + received.numel()) * send.element_size()
    for (offset, rows_per_rank, row_numel), (name, source, target) in zip(
        layout, bucket, strict=True
    ):
        pieces = []
        index = shard_of(target) if isinstance(target, DTensor) else None
        for r in range(world):
            first_row = r * rows_per_rank
            rows = max(0, min(rows_per_rank, source.shape[0] - first_row))
            piece = received[r, offset : offset + rows * row_numel]
            if not isinstance(target, DTensor):  # written in place, rank by rank
                start = first_row * row_numel
                target.view(-1)[start : start + piece.numel()].copy_(piece)
            elif not check:  # a TP generator's shard: the rows of it this piece holds
                _write_overlap(target, index, piece.view(rows, *source.shape[1:]), first_row)
            pieces.append(piece)
        if check:  # the whole tensor, to compare with
            full = torch.cat(pieces).view(source.shape)
            if isinstance(target, DTensor):
                _write(target, full)
            _check(name, full, target)
    return held


def _write_overlap(target: DTensor, index: tuple, rows: torch.Tensor, first_row: int) -> None:
    """Write into `target`'s shard (at `index` of the whole tensor: `shard_of`) the part of it
    that `rows` (consecutive rows of the whole tensor, from `first_row`) hold, without
    assembling the whole tensor."""
    lo = max(first_row, index[0].start)
    hi = min(first_row + rows.shape[0], index[0].stop)
    if lo < hi:
        part = rows[lo - first_row : hi - first_row][(slice(None), *index[1:])]
        target.to_local()[lo - index[0].start : hi - index[0].start].copy_(part)


class WeightSync:
    """Copies trainer parameters into generator parameters of the same torchtitan FQN.

    `trainer_params` and `generator_params` map FQN -> parameter (tied weights once each); a
    trainer source may be a LoRA policy's `Merged` weight. Mismatching names or shapes are a
    WeightSyncError naming them, raised here, once.
    """

    def __init__(
        self,
        trainer_params: dict[str, nn.Parameter],
        generator_params: dict[str, nn.Parameter],
        *,
        bucket_mb: float = 64.0,
        verify: bool = False,
        trained_buffers=frozenset(),
    ):
        check_same_parameters(trainer_params, generator_params)
        self.verify = verify
        nbytes = {n: t.numel() * t.element_size() for n, t in generator_params.items()}
        self.plan = Plan(nbytes, changing(trainer_params, trained_buffers), bucket_mb)

        def triples(names: list[str]) -> list[tuple[str, object, nn.Parameter]]:
            return [(n, trainer_params[n], generator_params[n]) for n in names]

        self.buckets = [triples(names) for names in self.plan.all]
        self.update_buckets = [triples(names) for names in self.plan.changed]
        self.shared = self._shared_gather()

    def _shared_gather(self) -> "platform.HostSharedGather | None":
        """Shared memory for the FSDP gathers where the ranks share a host (platform.py),
        sized for the largest bucket of either plan: the buckets of only the changing weights
        are packed anew, and one can gather more than any bucket of all the weights (measured:
        debugmodel_moe, whose frozen router biases drop out, 28.3 MB against a 27.3 MB slot)."""
        gathered = [b for b in (*self.buckets, *self.update_buckets) if _gathers_fsdp(b)]
        if not gathered:
            return None
        slot_bytes = max(_gather_layout(b)[1] * b[0][2].element_size() for b in gathered)
        mesh = _placed(gathered[0][0][1]).device_mesh
        return platform.host_shared_gather(mesh.get_group(), slot_bytes)

    @torch.no_grad()
    def copy(self, everything: bool = True) -> tuple[int, int]:
        """Copy every parameter (or, not `everything`, those a step changes), bucket by bucket;
        returns (bytes written, peak extra bytes)."""
        written, peak = 0, 0
        for bucket in self.buckets if everything else self.update_buckets:
            peak = max(peak, _copy_bucket(bucket, self.verify, self.shared))
            written += sum(target.numel() * target.element_size() for _, _, target in bucket)
        return written, peak


class LocalTransport:
    """The colocated Transport (base.py): a WeightSync from a PolicyTrainer into the LocalGenerator
    of the same process (their live parameters)."""

    def __init__(self, trainer, generator, *, bucket_mb: float, verify: bool):
        self.generator = generator
        self.copier = WeightSync(
            trainer.sync_sources(),
            generator.weights(),
            bucket_mb=bucket_mb,
            verify=verify,
            trained_buffers=trainer.trained_buffers,
        )

    @property
    def verify(self) -> bool:
        return self.copier.verify

    @classmethod
    def build(cls, config, trainer, generator) -> "LocalTransport":
        """The transport of a run (`weight_sync.transport`): to this process's LocalGenerator."""
        return cls(
            trainer,
            generator,
            bucket_mb=config.generator.weight_sync_bucket_mb,
            verify=config.generator.verify_weight_sync,
        )

    def send(self, version: int) -> SyncStats:
        """Copy the weights (`base.Plan`: all of them first, or after the generator dropped
        them, `generator.weights_dropped`; then what a step changes), refresh the generator,
        and tag it with `version`."""
        start = time.perf_counter()
        plan = self.copier.plan
        everything = plan.next(everything=self.generator.weights_dropped) is plan.all
        written, peak = self.copier.copy(everything=everything)
        self.generator.refresh_after_weight_update()
        self.generator.policy_version = version
        seconds = time.perf_counter() - start
        return SyncStats(
            bytes=written,
            seconds=seconds,
            gb_per_s=written / seconds / 1e9,
            peak_extra_bytes=peak,
            version=version,
        )

    def stop(self) -> None:
        """Nothing to tell: the generator is in this process."""
