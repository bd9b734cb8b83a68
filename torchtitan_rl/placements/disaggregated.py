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

Preemption (watchdog.py): a generator rank asked to stop says so with its next rollout; the
trainers stop after that step, write a checkpoint, and trainer rank 0 sends the generators a
stop header where the next weights would come (`BroadcastSender.stop`).

Resume: trainers restore the checkpoint and broadcast its weights first. Rollouts that were in
flight when the run stopped are discarded and regenerated: prompts and seeds are functions of
the step, so the regenerated rollouts sample the same prompts.
"""

import pickle
import socket
import time
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from torchtitan_rl import batch_invariant, platform, watchdog
from torchtitan_rl.checkpoint import Checkpointer, TrainState, run_facts
from torchtitan_rl.config import JobConfig
from torchtitan_rl.episodes import OpenTask, open_task
from torchtitan_rl.evaluation import build_evaluator, log_eval
from torchtitan_rl.generator.remote import EngineWorld, RemoteGenerator
from torchtitan_rl.learner import Learner, rollout_metrics
from torchtitan_rl.loop import Hooks, step_metrics, train
from torchtitan_rl.metrics import run_metrics
from torchtitan_rl.producer import RolloutProducer, engine_failure_at
from torchtitan_rl.trainer.policy_trainer import NonFiniteError
from torchtitan_rl.types import EvalShard, Rollout, Rollouts
from torchtitan_rl.weight_sync import SyncStats, transport
from torchtitan_rl.weight_sync.broadcast import BroadcastReceiver


class ContinuousSide(Protocol):
    """What the continuous placement adds to its trainer ranks (continuous.TrainerSide)."""

    def announce(self, version: int) -> None:
        """Trainer rank 0, before version `version`'s broadcast (or a stop)."""

    def figures(
        self, step: int, messages: list[Rollout], state: TrainState, group
    ) -> dict[str, float]:
        """The step's figures of the token versions; records its groups in `state`."""


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
    engine_groups: list[tuple[dist.ProcessGroup, list[int]]] | None = None
    """gloo over the generator ranks of each tensor-parallel engine, with their ranks (None:
    one engine per generator rank)."""

    @classmethod
    def build(cls, config: JobConfig) -> "Topology":
        world, generators = dist.get_world_size(), config.generator.num_ranks
        trainers = list(range(world - generators))
        generator_ranks = list(range(world - generators, world))
        async_saves = config.checkpoint.enable and config.checkpoint.async_mode == "async"
        tp = config.generator.parallelism.tensor_parallel_degree
        engines = [generator_ranks[i : i + tp] for i in range(0, generators, tp)]
        return cls(
            trainers=trainers,
            generators=generator_ranks,
            trainer_group=dist.new_group(trainers),
            transfer_group=dist.new_group([trainers[0], *generator_ranks]),
            checkpoint_group=dist.new_group(trainers, backend="gloo") if async_saves else None,
            engine_groups=(
                [(dist.new_group(ranks, backend="gloo"), ranks) for ranks in engines]
                if tp > 1
                else None
            ),
        )

    def engine_world(self, generator_rank: int) -> EngineWorld | None:
        """Where the engine children of `generator_rank`'s tensor-parallel engine meet (None:
        an engine of one rank): its first rank's host and a free port there."""
        if self.engine_groups is None:
            return None
        tp = len(self.engine_groups[0][1])
        index = self.generators.index(generator_rank)
        group, ranks = self.engine_groups[index // tp]
        offer = (socket.gethostname(), _free_port()) if index % tp == 0 else None
        address, port = platform.all_gather_objects(offer, group=group)[0]
        return EngineWorld(address=address, port=port, rank=index % tp, size=len(ranks))

    def trainer_of(self, generator_rank: int) -> int:
        return self.trainers[self.generators.index(generator_rank) % len(self.trainers)]


def _free_port() -> int:
    """A TCP port free on this host now (the OS picks it)."""
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


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


def _start_step(topology: Topology, state: TrainState | None = None) -> tuple[int, int]:
    """Trainer rank 0 tells every rank where the run starts (0, or the restored step) and the
    reward errors counted before it (the run's, every rank's: TrainState.reward_errors)."""
    start = torch.tensor([state.step, state.reward_errors] if state else [0, 0])
    dist.broadcast(start, topology.trainers[0])
    return int(start[0]), int(start[1])


def _generator_start(topology: Topology, producer: RolloutProducer) -> int:
    """A generator rank's `_start_step`: where the run starts. Of a resumed run's count of
    reward errors, the first generator rank carries it on and the others start from 0 (the
    metric adds up every rank's count)."""
    start, errors = _start_step(topology)
    producer.reward_errors = errors if dist.get_rank() == topology.generators[0] else 0
    return start


class GeneratorWorker:
    """A generator-only rank: sample, score, send; take new weights when the bound needs them."""

    def __init__(self, config: JobConfig, topology: Topology, task: OpenTask | None = None):
        self.config, self.topology = config, topology
        self.rank = dist.get_rank()
        if config.batch_invariant:
            batch_invariant.enable_for(config)
        task = task or open_task(config)  # before the engine: a bad dataset row fails in seconds
        # Prompts and seeds are split over the generator ranks' engines (one per rank, or per
        # generator TP group); each rank sends its part of its engine's rollouts.
        index, count = topology.generators.index(self.rank), len(topology.generators)
        self.producer = RolloutProducer(config, task, index, count)
        self.generator = RemoteGenerator(
            generator=config.generator,
            model=config.model,
            seed=config.job.seed + self.producer.shard,
            world=topology.engine_world(self.rank),
        )
        self.receiver = BroadcastReceiver(
            self.generator,
            leader=topology.trainers[0],
            group=topology.transfer_group,
            bucket_mb=config.generator.weight_sync_bucket_mb,
            verify=config.generator.verify_weight_sync,
        )

    def take_weights(self) -> None:
        """Receive the next policy version, and evaluate it when it is due; raises Preempted
        when the trainers stop the run instead."""
        # Waiting on the trainers' step: their phases are timed (watchdog.py), not this wait.
        watchdog.mark(self.generator.policy_version + 1, "wait_weights", timed=False)
        # The weights of step v + 1: an engine that dies while taking them names that step.
        with engine_failure_at(f"step {self.generator.policy_version + 1}"):
            received = self.receiver.receive()
        if not received:
            raise watchdog.Preempted("the trainers stopped the run")
        version = self.generator.policy_version
        # A resumed run's restored version too: the stopped run's generators evaluated it, but
        # its result travels with the next step's rollout, which the stopped trainers never
        # took (version 0: eval.at_start).
        if self.producer.eval_due(version):
            watchdog.mark(version, "eval")
            self.evaluations.append(self.producer.evaluate(self.generator, version))

    def run(self) -> None:
        steps, k = self.config.training.steps, self.config.algorithm.max_offpolicy_steps
        verify = self.config.generator.verify_weight_sync
        start = _generator_start(self.topology, self.producer)
        self.evaluations = []
        self.take_weights()  # the starting (or restored) weights
        pending: list = []
        trainer = self.topology.trainer_of(self.rank)
        for step in range(start + 1, steps + 1):
            while self.generator.policy_version < max(start, step - 1 - k):
                self.take_weights()
            began = time.perf_counter()
            watchdog.mark(step, "generate")
            rollouts = self.producer.rollouts(step, self.generator)
            rollout = Rollout(
                step=step,
                version=self.generator.policy_version,
                weights_sha256=self.receiver.digest() if verify else None,
                rollouts=rollouts,
                reward_errors=self.producer.counted_reward_errors,
                generate_s=time.perf_counter() - began,
                evaluations=self.evaluations,
                stop_requested=watchdog.stop_requested(),
            )
            self.evaluations = []
            _send(rollout, trainer, pending)
            while len(pending) > k + 1:  # what the trainer has not taken yet
                for work in pending.pop(0)[2:]:
                    work.wait()
        while self.generator.policy_version < steps:  # the trainer's last broadcasts
            self.take_weights()
        self.send_last(trainer, pending)
        self.generator.close()

    def send_last(self, trainer: int, pending: list) -> None:
        """After the last step: the evaluation of the last version, which the trainer waits
        for; then wait until every message went out."""
        if self.producer.evaluator is not None:
            steps = self.config.training.steps
            errors = self.producer.counted_reward_errors
            last = Rollout(steps + 1, steps, None, None, errors, 0.0, self.evaluations)
            _send(last, trainer, pending)
        for *_, size_sent, data_sent in pending:
            size_sent.wait()
            data_sent.wait()


class DisaggregatedTrainer:
    """A trainer-only rank: receive rollouts, train, broadcast the weights."""

    def __init__(
        self,
        config: JobConfig,
        topology: Topology,
        hooks: Hooks | None = None,
        task: OpenTask | None = None,
        continuous: "ContinuousSide | None" = None,
    ):
        """`continuous`: the continuous placement's part of the trainer ranks
        (continuous.TrainerSide): its weights announced, its groups recorded, its figures."""
        self.config, self.topology, self.hooks = config, topology, hooks or Hooks()
        self.rank, self.group = dist.get_rank(), topology.trainer_group
        self.continuous = continuous
        if config.batch_invariant:
            batch_invariant.enable_for(config)
        torch.manual_seed(config.job.seed)
        self.checkpointer = Checkpointer(
            config.checkpoint,
            config.job.dump_folder,
            run_facts(config),
            group=topology.trainer_group,
            async_group=topology.checkpoint_group,
        )
        resume_path = self.checkpointer.find()
        task = task or open_task(config)
        # The generators evaluate and send the results; this side logs them.
        self.evaluates = build_evaluator(config, task) is not None
        self.learner = Learner(config, task.renderer_of, topology.trainer_group)
        # Continuous: the groups trained on, by generator (continuous.Cursor), in checkpoints.
        self.state = TrainState(cursors={} if continuous else None)
        self.checkpointer.attach(self.learner.trainer, self.state)
        self.start_step = self.checkpointer.load(resume_path) if resume_path else 0
        self.metrics = run_metrics(
            config, enabled=self.rank == topology.trainers[0], resume_step=self.start_step
        )
        self.learner.metrics = self.metrics
        self.sources = [g for g in topology.generators if topology.trainer_of(g) == self.rank]
        self.transport = transport(config, self.learner.trainer, topology)
        self.sent_digests: dict[int, str | None] = {}

    def send_weights(self, version: int) -> SyncStats:
        if self.continuous and self.rank == self.topology.trainers[0]:
            self.continuous.announce(version)  # the generators poll for it between steps
        stats = self.transport.send(version)
        self.sent_digests[version] = stats.digest
        return stats

    def train(self) -> None:
        train(self)

    def begin(self) -> None:
        _start_step(self.topology, self.state)
        if self.continuous:  # where each generator's groups start again
            dist.broadcast_object_list([self.state.cursors], self.topology.trainers[0])
        watchdog.mark(self.start_step, "weight_sync")
        self.send_weights(self.start_step)

    def after_step(self, step: int) -> None:
        self.state.step = self.state.policy_version = step

    def stop(self, step: int) -> None:
        if self.continuous and self.rank == self.topology.trainers[0]:
            self.continuous.announce(step + 1)  # a stop comes where those weights would
        self.transport.stop()  # the generators leave their loop

    def end(self) -> None:
        if self.evaluates:  # the evaluation of the last version, in a message of its own
            self.log_evaluations(self.config.training.steps, [_receive(s) for s in self.sources])

    def log_evaluations(self, step: int, messages: list[Rollout]) -> None:
        """Sum the evaluations the generators sent with `messages` over every trainer rank
        (each generator evaluates the same versions at the same point of its loop), and log
        them at `step`, one row per version."""
        by_version: dict[int, list[EvalShard]] = {}
        for message in messages:
            for evaluation in message.evaluations:
                by_version.setdefault(evaluation.version, []).append(evaluation)
        for version in sorted(by_version):
            log_eval(self.metrics, step, by_version[version], self.group)

    def receive(self, step: int) -> list[Rollout]:
        rollouts: list[Rollout] = [_receive(src) for src in self.sources]
        k = self.config.algorithm.max_offpolicy_steps
        for rollout in rollouts:
            if rollout.stop_requested:  # a signal to a generator rank: stop after this step
                watchdog.request_stop(rollout.stop_requested)
            age = step - 1 - rollout.version  # the trainer sent version step - 1 last
            if rollout.step != step or age > k:
                raise StalenessError(
                    f"step {step}: got the rollout of step {rollout.step}, sampled with policy "
                    f"version {rollout.version}, {age} versions old; "
                    f"algorithm.max_offpolicy_steps = {k}"
                )
        return rollouts

    def train_step(self, step: int) -> dict[str, float]:
        watchdog.mark(step, "generate")  # the generator ranks' part: their rollouts arrive
        self.hooks.before_step(step)
        start = time.perf_counter()
        messages = self.receive(step)
        received = time.perf_counter()
        self.log_evaluations(step, messages)
        rollouts = Rollouts.cat([m.rollouts for m in messages])
        watchdog.mark(step, "train")
        learned = self.learner.learn(step, rollouts)
        trained = time.perf_counter()
        self.hooks.after_train(step, learned)
        watchdog.mark(step, "weight_sync")
        sync = self.send_weights(step)
        synced = time.perf_counter()
        self.hooks.after_sync(step, sync)

        ages = [step - 1 - m.version for m in messages]
        verified = [
            float(m.weights_sha256 == self.sent_digests.get(m.version))
            for m in messages
            if m.weights_sha256 is not None and self.sent_digests.get(m.version) is not None
        ]
        figures = torch.tensor([float(sum(ages)), float(len(ages)), float(max(ages))])
        platform.all_reduce_host(figures[:2], group=self.group)
        platform.all_reduce_host(figures[2:], op=dist.ReduceOp.MAX, group=self.group)
        placement = {
            "policy_age/mean": float(figures[0] / figures[1]),
            "policy_age/max": float(figures[2]),
            "rollout_version/min": float(min(m.version for m in messages)),
            "time/wait_rollout_s": received - start,
        }
        if self.continuous:
            placement.update(self.continuous.figures(step, messages, self.state, self.group))
        # The slowest generator's time, environments apart (colocated: this rank's).
        env_s = max(m.rollouts.env_s for m in messages)
        seconds = {
            "generate": max(m.generate_s - m.rollouts.env_s for m in messages),
            "env": env_s,
            "train": trained - received,
            "weight_sync": synced - trained,
            "step": synced - start,
        }
        errors = sum(m.reward_errors for m in messages)
        metrics = step_metrics(
            rollout_metrics(self.config, rollouts, errors, self.group),
            learned,
            placement,
            version=step,
            seconds=seconds,
            sync=sync,
            verified=min(verified) if verified else None,
        )
        self.state.reward_errors = int(metrics["reward/errors"])  # every generator's count
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
