"""Disaggregated placement: generator ranks apart from trainer ranks, with bounded staleness.

    torchrun --standalone --nproc_per_node 2 -m torchtitan_rl.train \
        --job.config_file run_configs/debug_cpu.toml \
        --generator.placement disaggregated --algorithm.max_offpolicy_steps 1

The first T ranks of the torchrun world train (their own FSDP mesh and process group); the last
G = generator.num_ranks ranks only generate, each with its engine in a child process
(generator/remote.py). Generator g samples and scores its share of each step's prompts and sends
the rollout, with the policy version it sampled with, to trainer rank g % T. After every
optimizer step trainer rank 0 broadcasts the weights bucket by bucket (gloo on CPU, NCCL on
CUDA) to every generator rank, which writes them in place into its engine's parameters and
refreshes it (repack, prefix-cache reset), as colocated sync does.

Staleness: step s may be sampled with a policy version >= s - 1 - k (k =
algorithm.max_offpolicy_steps), so generators sample steps s+1..s+k while the trainer trains
step s; k = 0 is the synchronous loop. A generator waits for the version it needs before it
samples; the trainer refuses a rollout older than k (StalenessError).

Evaluation: each generator rank evaluates its shard of the eval set with every policy version
that is due (eval.interval) as soon as it takes those weights, between its steps, and sends the
result with its next rollout (the last version's in a message of its own after the last step);
trainer rank 0 logs the sum, naming the version (eval/policy_version) at the step it arrived.

Resume: trainers restore the checkpoint and broadcast its weights first. Rollouts that were in
flight when the run stopped are discarded and regenerated: prompts and seeds are functions of
the step, so the regenerated rollouts sample the same prompts.
"""

import hashlib
import math
import pickle
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torchtitan_rl import batch_invariant, platform
from torchtitan_rl.algorithms import build_loss
from torchtitan_rl.checkpoint import Checkpointer, TrainState, run_facts
from torchtitan_rl.config.job_config import JobConfig
from torchtitan_rl.episodes import OpenTask
from torchtitan_rl.generator.remote import RemoteGenerator
from torchtitan_rl.rl_trainer import Hooks, RLTrainer
from torchtitan_rl.trainer.lora import Merged
from torchtitan_rl.trainer.policy_trainer import NonFiniteError
from torchtitan_rl.types import EvalShard, Rollout, Rollouts
from torchtitan_rl.weight_sync import SyncStats


class StalenessError(NonFiniteError):
    """A rollout older than algorithm.max_offpolicy_steps reached the trainer."""


@dataclass
class Topology:
    """Who trains, who generates, and the groups between them. Every rank builds it, in the
    same order (group creation is collective)."""

    trainers: list[int]
    generators: list[int]
    trainer_group: dist.ProcessGroup
    transfer_group: dist.ProcessGroup
    """Trainer rank 0 and every generator rank: the weight broadcast."""
    checkpoint_group: dist.ProcessGroup | None
    """gloo over the trainers, for background checkpoint saves."""

    @classmethod
    def build(cls, config: JobConfig) -> "Topology":
        world, generators = dist.get_world_size(), config.generator.num_ranks
        trainers = list(range(world - generators))
        async_saves = config.checkpoint.enable and config.checkpoint.async_mode == "async"
        return cls(
            trainers=trainers,
            generators=list(range(world - generators, world)),
            trainer_group=dist.new_group(trainers),
            transfer_group=dist.new_group([trainers[0], *range(world - generators, world)]),
            checkpoint_group=dist.new_group(trainers, backend="gloo") if async_saves else None,
        )

    def trainer_of(self, generator_rank: int) -> int:
        return self.trainers[self.generators.index(generator_rank) % len(self.trainers)]


def _buckets(params: dict[str, torch.Tensor], bucket_mb: float) -> list[list[str]]:
    """Parameter names in buckets of about `bucket_mb` (fp32 sizes), sorted: both sides
    compute the same buckets."""
    buckets, current, size = [], [], 0
    for name in sorted(params):
        nbytes = math.prod(params[name].shape) * 4
        if current and size + nbytes > bucket_mb * 2**20:
            buckets.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    return buckets + ([current] if current else [])


def _digest(tensors) -> str:
    sha = hashlib.sha256()
    for tensor in tensors:
        sha.update(_host_bytes(tensor))
    return sha.hexdigest()


def _host_bytes(tensor: torch.Tensor) -> bytes:
    """The tensor's raw bytes, copied to the host where it lives on a device."""
    return tensor.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()


def send_weights(params, dtype, topology: Topology, bucket_mb: float, version: int, verify: bool):
    """Trainer ranks: gather each bucket (FSDP shards, on the trainer mesh); trainer rank 0
    broadcasts it flat, in the generator's dtype. Returns (figures, digest or None)."""
    start = time.perf_counter()
    sent, peak, leader = 0, 0, dist.get_rank() == topology.trainers[0]
    sha = hashlib.sha256() if verify else None
    if leader:
        dist.broadcast(torch.tensor([version]), topology.trainers[0], topology.transfer_group)
    for names in _buckets(params, bucket_mb):
        # Gathered in the generator's dtype: a bf16 generator moves half the fp32 bytes.
        full = [_whole(params[name], dtype) for name in names]
        if leader:
            flat = torch.cat([t.detach().reshape(-1).to(dtype) for t in full])
            dist.broadcast(flat, topology.trainers[0], topology.transfer_group)
            sent += flat.numel() * flat.element_size()
            gathered = sum(t.numel() * t.element_size() for t in full)
            peak = max(peak, gathered + flat.numel() * flat.element_size())
            if sha is not None:
                sha.update(_host_bytes(flat))
    seconds = time.perf_counter() - start
    stats = SyncStats(
        bytes=sent,
        seconds=seconds,
        gb_per_s=sent / seconds / 1e9,
        peak_extra_bytes=peak,  # one bucket's gathered tensors and its flat copy
        version=version,
    )
    return stats, (sha.hexdigest() if sha is not None and leader else None)


def _whole(source, dtype: torch.dtype) -> torch.Tensor:
    """A sync source whole, in `dtype` (gathers DTensors and merges LoRA weights: every trainer
    rank calls it in the same order)."""
    if isinstance(source, Merged):
        return source.full(dtype)
    return source.to(dtype).full_tensor() if isinstance(source, DTensor) else source


def receive_weights(generator: RemoteGenerator, topology: Topology, bucket_mb: float) -> None:
    """Generator ranks: one broadcast, written in place into the engine's shared parameters."""
    params = generator.named_parameters()
    version = torch.zeros(1, dtype=torch.long)
    dist.broadcast(version, topology.trainers[0], topology.transfer_group)
    with torch.no_grad():
        for names in _buckets(params, bucket_mb):
            targets = [params[n] for n in names]
            flat = torch.empty(
                sum(t.numel() for t in targets), dtype=targets[0].dtype, device=targets[0].device
            )
            dist.broadcast(flat, topology.trainers[0], topology.transfer_group)
            for target, piece in zip(
                targets, flat.split([t.numel() for t in targets]), strict=True
            ):
                target.copy_(piece.view_as(target))
    generator.refresh_after_weight_update()
    generator.policy_version = int(version)


def _send(obj, dst: int, pending: list) -> None:
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.long)
    pending.append((size, data, dist.isend(size, dst), dist.isend(data, dst)))


def _receive(src: int):
    size = torch.zeros(1, dtype=torch.long)
    dist.recv(size, src)
    data = torch.empty(int(size), dtype=torch.uint8)
    dist.recv(data, src)
    return pickle.loads(data.numpy().tobytes())


def _start_step(topology: Topology, checkpoint_step: int) -> int:
    """Trainer rank 0 tells every rank where the run starts (0, or the restored step)."""
    step = torch.tensor([checkpoint_step])
    dist.broadcast(step, topology.trainers[0])
    return int(step)


class GeneratorWorker(RLTrainer):
    """A generator-only rank: sample, score, send; take new weights when the bound needs them."""

    def __init__(self, config: JobConfig, topology: Topology, task: OpenTask | None = None):
        self.config, self.topology, self.hooks = config, topology, Hooks()
        self.rank, self.group = dist.get_rank(), None
        if config.batch_invariant:
            batch_invariant.enable()
        # Prompts and seeds are split over the generator ranks only.
        self.shard, self.shards = topology.generators.index(self.rank), len(topology.generators)
        self.build_task(task)  # before the engine: a bad dataset row fails in seconds
        self.generator = RemoteGenerator(
            generator=config.generator, model=config.model, seed=config.job.seed + self.shard
        )

    def take_weights(self) -> None:
        """Receive the next policy version, and evaluate it when it is due."""
        receive_weights(self.generator, self.topology, self.config.generator.weight_sync_bucket_mb)
        version = self.generator.policy_version
        due = self.evaluator is not None and self.evaluator.due(version, self.last_step)
        # A resumed run evaluated its restored version before it stopped (version 0: at_start).
        if due and (version > self.start or self.start == 0):
            evaluation = self.evaluator.run(self.generator, version, self.shard, self.shards)
            self.evaluations.append(evaluation)

    def run(self) -> None:
        steps, k = self.config.training.steps, self.config.algorithm.max_offpolicy_steps
        verify = self.config.generator.verify_weight_sync
        start = _start_step(self.topology, 0)
        self.start, self.last_step, self.evaluations = start, steps, []
        self.take_weights()  # the starting (or restored) weights
        pending: list = []
        trainer = self.topology.trainer_of(self.rank)
        for step in range(start + 1, steps + 1):
            while self.generator.policy_version < max(start, step - 1 - k):
                self.take_weights()
            began = time.perf_counter()
            rollouts = self.rollouts(step)
            params = self.generator.named_parameters()
            rollout = Rollout(
                step=step,
                version=self.generator.policy_version,
                # In the order the trainer broadcasts: sorted names (see _buckets).
                weights_sha256=_digest(params[n] for n in sorted(params)) if verify else None,
                rollouts=rollouts,
                reward_errors=self.scorer.errors,
                generate_s=time.perf_counter() - began,
                evaluations=self.evaluations,
            )
            self.evaluations = []
            _send(rollout, trainer, pending)
            while len(pending) > k + 1:  # what the trainer has not taken yet
                for work in pending.pop(0)[2:]:
                    work.wait()
        while self.generator.policy_version < steps:  # the trainer's last broadcasts
            self.take_weights()
        if self.evaluator is not None:  # the trainer waits for it: the last version's eval
            last = Rollout(steps + 1, steps, None, None, self.scorer.errors, 0.0, self.evaluations)
            _send(last, trainer, pending)
        for *_, size_sent, data_sent in pending:
            size_sent.wait()
            data_sent.wait()
        self.generator.close()


class DisaggregatedTrainer(RLTrainer):
    """A trainer-only rank: receive rollouts, train, broadcast the weights."""

    def __init__(
        self,
        config: JobConfig,
        topology: Topology,
        hooks: Hooks | None = None,
        task: OpenTask | None = None,
    ):
        self.config, self.topology, self.hooks = config, topology, hooks or Hooks()
        self.rank, self.group = dist.get_rank(), topology.trainer_group
        if config.batch_invariant:
            batch_invariant.enable()
        torch.manual_seed(config.job.seed)
        self.checkpointer = Checkpointer(
            config.checkpoint,
            config.job.dump_folder,
            run_facts(config),
            group=topology.trainer_group,
            async_group=topology.checkpoint_group,
        )
        resume_path = self.checkpointer.find()
        self.build_task(task)
        self.trainer = self.policy(topology.trainer_group)
        self.reference = None
        if config.algorithm.kl_beta > 0:
            self.reference = self.policy(topology.trainer_group, trained=False)
        self.loss = build_loss(config.algorithm, max_tokens=config.episode_tokens)
        self.state = TrainState()
        self.checkpointer.attach(self.trainer, self.state)
        self.start_step = self.checkpointer.load(resume_path) if resume_path else 0
        self.build_metrics(enabled=self.rank == topology.trainers[0])
        self.sources = [g for g in topology.generators if topology.trainer_of(g) == self.rank]
        self.dtype = getattr(torch, config.generator.dtype)
        self.sent_digests: dict[int, str | None] = {}

    def send_weights(self, version: int) -> SyncStats:
        stats, digest = send_weights(
            self.trainer.sync_sources(),
            self.dtype,
            self.topology,
            self.config.generator.weight_sync_bucket_mb,
            version,
            verify=self.config.generator.verify_weight_sync,
        )
        self.trainer.policy_version = version
        self.sent_digests[version] = digest
        return stats

    def train(self) -> None:
        steps = self.config.training.steps
        _start_step(self.topology, self.start_step)
        self.send_weights(self.start_step)
        for step in range(self.start_step + 1, steps + 1):
            self.train_step(step)
            self.state.step = self.state.policy_version = step
            if self.checkpointer.should_save(step, last=step == steps):
                self.checkpointer.save(step)
            self.checkpointer.poll()
        if self.evaluator is not None:
            self.log_evaluations(steps, [_receive(src) for src in self.sources])
        self.checkpointer.close()
        self.metrics.close()

    def log_evaluations(self, step: int, messages: list[Rollout]) -> None:
        """Sum the evaluations the generators sent with `messages` over every trainer rank
        (each generator evaluates the same versions at the same point of its loop), and log
        them at `step`, one row per version."""
        by_version: dict[int, list[EvalShard]] = {}
        for message in messages:
            for evaluation in message.evaluations:
                by_version.setdefault(evaluation.version, []).append(evaluation)
        for version in sorted(by_version):
            self.log_eval(step, by_version[version])

    def receive(self, step: int) -> list[Rollout]:
        rollouts: list[Rollout] = [_receive(src) for src in self.sources]
        k = self.config.algorithm.max_offpolicy_steps
        for rollout in rollouts:
            age = self.trainer.policy_version - rollout.version
            if rollout.step != step or age > k:
                raise StalenessError(
                    f"step {step}: got the rollout of step {rollout.step}, sampled with policy "
                    f"version {rollout.version}, {age} versions old; "
                    f"algorithm.max_offpolicy_steps = {k}"
                )
        return rollouts

    def train_step(self, step: int) -> dict[str, float]:
        self.hooks.before_step(step)
        start = time.perf_counter()
        rollouts = self.receive(step)
        received = time.perf_counter()
        self.log_evaluations(step, rollouts)
        joined = Rollouts.cat([r.rollouts for r in rollouts])
        learned = self.learn(step, joined)
        trained = time.perf_counter()
        self.hooks.after_train(step, learned)
        stats = self.send_weights(step)
        synced = time.perf_counter()
        self.hooks.after_sync(step, stats)

        ages = [step - 1 - r.version for r in rollouts]
        verified = [
            float(r.weights_sha256 == self.sent_digests.get(r.version))
            for r in rollouts
            if r.weights_sha256 is not None and self.sent_digests.get(r.version) is not None
        ]
        figures = torch.tensor([float(sum(ages)), float(len(ages)), float(max(ages))])
        platform.all_reduce_host(figures[:2], group=self.group)
        platform.all_reduce_host(figures[2:], op=dist.ReduceOp.MAX, group=self.group)
        generate_s = max(r.generate_s for r in rollouts)
        metrics = {
            **self.rollout_metrics(joined, sum(r.reward_errors for r in rollouts)),
            **learned,
            "policy_version": float(step),
            "policy_age/mean": float(figures[0] / figures[1]),
            "policy_age/max": float(figures[2]),
            "rollout_version/min": float(min(r.version for r in rollouts)),
            "batch_invariant": float(batch_invariant.is_enabled()),
            "time/generate_s": generate_s,
            "time/wait_rollout_s": received - start,
            "time/train_s": trained - received,
            "time/weight_sync_s": synced - trained,
            "time/step_s": synced - start,
            "weight_sync/gb_per_s": stats.gb_per_s,
            "weight_sync/bytes": float(stats.bytes),
        }
        if verified:
            metrics["weight_sync/verified"] = min(verified)
        metrics["throughput/generated_tokens_per_s"] = metrics["generated_tokens"] / max(
            generate_s, 1e-9
        )
        self.metrics.log(step, metrics)
        self.hooks.after_step(step, metrics)
        return metrics


def run(config: JobConfig, hooks: Hooks | None = None, task: OpenTask | None = None) -> None:
    """Every rank of a disaggregated run: build the topology, then train or generate (with
    `task` opened, or opening it when None)."""
    topology = Topology.build(config)
    if dist.get_rank() in topology.generators:
        GeneratorWorker(config, topology, task).run()
    else:
        DisaggregatedTrainer(config, topology, hooks, task).train()
