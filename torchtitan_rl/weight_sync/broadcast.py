"""The disaggregated transport: trainer rank 0 broadcasts the weights, bucket by bucket, to
the generator ranks, which write them in place into their engines' parameters (what is sent,
and the check: base.py).

    .venv/bin/python -m pytest tests/integration/test_disaggregated.py

Every trainer rank gathers each bucket (FSDP shards, LoRA merges: collectives on the trainer
mesh); trainer rank 0 sends it flat, in the generator's dtype (a bf16 generator moves half the
fp32 bytes), over gloo on CPU and NCCL on CUDA. A sync starts with a header: the policy
version, and whether every weight follows; the first one also names the changing weights.
With verification, each side keeps one digest of the weights (`base.weights_digest`): the
trainer's of what it sent, the generator's of what it holds, compared when a rollout arrives.
"""

import math
import threading
import time

import torch
import torch.distributed as dist

from torchtitan_rl.weight_sync.base import (
    Plan,
    SyncStats,
    changing,
    digest,
    verify,
    weights_digest,
    whole,
)

# The header's version when no weights follow: the run stops (preempted).
STOP = -1


class BroadcastSender:
    """The disaggregated Transport (base.py), on the trainer ranks: send `sources`
    (PolicyTrainer.sync_sources) to the generator ranks of `group`, from rank `leader`, in
    `dtype`. With `verify`, the leader keeps the digest of what it sent (`SyncStats.digest`),
    which the generators' own must equal."""

    def __init__(
        self,
        sources: dict,
        dtype: torch.dtype,
        *,
        leader: int,
        group,
        bucket_mb: float,
        verify: bool = False,
        trained_buffers=frozenset(),
    ):
        self.sources, self.dtype, self.leader, self.group = sources, dtype, leader, group
        self.verify = verify
        nbytes = {n: math.prod(s.shape) * dtype.itemsize for n, s in sources.items()}
        self.changing = changing(sources, trained_buffers)
        self.plan = Plan(nbytes, self.changing, bucket_mb)
        self.digests: dict[str, bytes] = {}

    @classmethod
    def build(cls, config, trainer, topology) -> "BroadcastSender":
        """The transport of a run (`weight_sync.transport`): from the first trainer rank to
        the generator ranks of `topology` (disaggregated.Topology)."""
        return cls(
            trainer.sync_sources(),
            getattr(torch, config.generator.dtype),
            leader=topology.trainers[0],
            group=topology.transfer_group,
            bucket_mb=config.generator.weight_sync_bucket_mb,
            verify=config.generator.verify_weight_sync,
            trained_buffers=trainer.trained_buffers,
        )

    @property
    def is_leader(self) -> bool:
        return dist.get_rank() == self.leader

    def send(self, version: int) -> SyncStats:
        """Send the next sync's buckets, headed by `version`."""
        start = time.perf_counter()
        buckets = self.plan.next()
        everything = buckets is self.plan.all
        if self.is_leader:
            header = torch.tensor([version, int(everything)])
            dist.broadcast(header, self.leader, self.group)
            if everything:
                dist.broadcast_object_list([sorted(self.changing)], self.leader, self.group)
        sent, peak = 0, 0
        for names in buckets:
            full = [whole(self.sources[name], self.dtype) for name in names]
            if not self.is_leader:
                continue
            flat = torch.cat([t.reshape(-1) for t in full])
            dist.broadcast(flat, self.leader, self.group)
            sent += flat.numel() * flat.element_size()
            gathered = sum(t.numel() * t.element_size() for t in full)
            peak = max(peak, gathered + flat.numel() * flat.element_size())
            if self.verify:
                self.digests.update({name: digest(t) for name, t in zip(names, full, strict=True)})
        seconds = time.perf_counter() - start
        return SyncStats(
            bytes=sent,
            seconds=seconds,
            gb_per_s=sent / seconds / 1e9,
            peak_extra_bytes=peak,  # one bucket's gathered tensors and its flat copy
            version=version,
            digest=weights_digest(self.digests) if self.verify and self.is_leader else None,
        )

    def stop(self) -> None:
        """Tell the generators the run stops: a header with no weights (version STOP)."""
        if self.is_leader:
            dist.broadcast(torch.tensor([STOP, 0]), self.leader, self.group)


class BroadcastReceiver:
    """Generator ranks: receive the weights from `leader` into `generator`'s parameters. A
    tensor-parallel engine's rank (`generator.shards`: name -> (whole shape, index of its
    shard)) receives every tensor whole and keeps its shard of it."""

    def __init__(self, generator, *, leader: int, group, bucket_mb: float, verify: bool = False):
        """`verify`: keep what `digest` needs (generator.verify_weight_sync)."""
        self.generator, self.leader, self.group = generator, leader, group
        self.bucket_mb, self.verify = bucket_mb, verify
        self.plan: Plan | None = None
        self.shards: dict = getattr(generator, "shards", {})
        self.whole_digests: dict[str, bytes] = {}
        """The digest of each sharded tensor as received whole (its shard checked against it)."""

    def _numel(self, name: str, param: torch.Tensor) -> int:
        """The whole tensor's numel (a shard's: of the tensor it is part of)."""
        return math.prod(self.shards[name][0]) if name in self.shards else param.numel()

    @torch.no_grad()
    def receive(self) -> bool:
        """One sync: written in place, the engine refreshed, the policy version taken; False
        when the trainers sent STOP instead (the run stops: `BroadcastSender.stop`)."""
        params = self.generator.weights()
        buckets = self.next_sync(params)
        if buckets is None:
            return False
        version, names_of = buckets
        for names in names_of:
            self.write(names, self.receive_bucket(names, params), params)
        self.take_version(version)
        return True

    def next_sync(self, params: dict) -> tuple[int, list[list[str]]] | None:
        """The next sync's header: its version and the names of each bucket that follows
        (None: STOP)."""
        header = torch.zeros(2, dtype=torch.long)
        dist.broadcast(header, self.leader, self.group)
        version, everything = int(header[0]), bool(header[1])
        if version == STOP:
            return None
        if everything and self.plan is None:
            names = [None]
            dist.broadcast_object_list(names, self.leader, self.group)
            nbytes = {n: self._numel(n, p) * p.element_size() for n, p in params.items()}
            self.plan = Plan(nbytes, set(names[0]), self.bucket_mb)
        elif everything:
            dist.broadcast_object_list([None], self.leader, self.group)
        return version, self.plan.all if everything else self.plan.changed

    def receive_bucket(self, names: list[str], params: dict, into: dict | None = None):
        """Receive one bucket, flat: into the buffer `into` keeps for its names (made on first
        use), or a new one."""
        into = {} if into is None else into
        key = tuple(names)
        if key not in into:
            targets = [params[n] for n in names]
            numel = sum(self._numel(n, t) for n, t in zip(names, targets, strict=True))
            into[key] = torch.empty(numel, dtype=targets[0].dtype, device=targets[0].device)
        dist.broadcast(into[key], self.leader, self.group)
        return into[key]

    def write(self, names: list[str], flat: torch.Tensor, params: dict) -> None:
        """Copy a received bucket into the engine's parameters (a shard: its part)."""
        targets = [params[n] for n in names]
        sizes = [self._numel(n, t) for n, t in zip(names, targets, strict=True)]
        for name, target, piece in zip(names, targets, flat.split(sizes), strict=True):
            if name not in self.shards:
                target.copy_(piece.view_as(target))
                continue
            shape, index = self.shards[name]
            whole_tensor = piece.view(shape)
            target.copy_(whole_tensor[index])
            if self.verify:
                self.whole_digests[name] = digest(whole_tensor)
                verify(name, whole_tensor[index], target)

    def take_version(self, version: int) -> None:
        self.generator.refresh_after_weight_update()
        self.generator.policy_version = version

    def digest(self) -> str:
        """The digest of the weights this generator holds (`base.weights_digest`): of each
        tensor whole; a shard's, of the whole tensor received with it (and the shard held
        checked against it bit for bit when written)."""
        params = self.generator.weights()
        return weights_digest(
            {
                name: self.whole_digests[name] if name in self.shards else digest(p)
                for name, p in params.items()
            }
        )


class StagedReceiver:
    """A BroadcastReceiver with a second copy of the weights (generator.double_buffer_weights,
    continuous placement): a thread receives the next version into it while the engine
    generates with the current one, and `receive` (between engine steps) copies it into the
    engine's parameters. The trainers' broadcast no longer waits for the engine's step, nor the
    engine for the broadcast; the price is one more copy of the weights on the generator rank."""

    def __init__(self, receiver: BroadcastReceiver):
        self.receiver = receiver
        self.thread: threading.Thread | None = None
        self.staged: tuple[int, list] | None = None
        self.error: BaseException | None = None
        self.buffers: dict[tuple, torch.Tensor] = {}
        """The second copy: a flat buffer per bucket, reused by every sync."""

    def _stage(self) -> None:
        """The thread: the next sync's buckets, flat, into `staged` (None: STOP)."""
        try:
            with torch.no_grad():
                params = self.receiver.generator.weights()
                buckets = self.receiver.next_sync(params)
                if buckets is not None:
                    version, names_of = buckets
                    receive = self.receiver.receive_bucket
                    flats = [(names, receive(names, params, self.buffers)) for names in names_of]
                    self.staged = version, flats
        except BaseException as e:  # re-raised by `receive`, on the generator's loop
            self.error = e

    def _start(self) -> None:
        self.staged, self.error = None, None
        self.thread = threading.Thread(target=self._stage, name="weights", daemon=True)
        self.thread.start()

    def ready(self) -> bool:
        """Whether the next sync (or STOP) has arrived whole: `receive` will not wait."""
        if self.thread is None:
            self._start()
        return not self.thread.is_alive()

    @torch.no_grad()
    def receive(self) -> bool:
        """Wait for the staged sync, copy it into the engine, refresh it, take its version, and
        start receiving the next; False on STOP."""
        if self.thread is None:
            self._start()
        self.thread.join()
        if self.error is not None:
            raise self.error
        if self.staged is None:
            return False
        (version, flats), params = self.staged, self.receiver.generator.weights()
        for names, flat in flats:
            self.receiver.write(names, flat, params)
        self._start()  # the next version arrives while this one generates
        self.receiver.take_version(version)
        return True

    def digest(self) -> str:
        return self.receiver.digest()
