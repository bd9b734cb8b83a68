"""Continuous placement: generator ranks keep their engines full and take new weights between
engine steps, without draining; the trainer ranks train on complete groups as they finish.

    torchrun --standalone --nproc_per_node 2 -m torchtitan_rl.train \
        --job.config_file run_configs/debug_cpu.toml \
        --generator.placement continuous --algorithm.max_offpolicy_steps 1

Ranks split as in disaggregated placement (disaggregated.py: its Topology, its trainer ranks,
its broadcast). A generator rank here runs every group of its prompts as coroutines on its
engine's request stream (generator/stream.py, episodes.Episodes.run_group): it admits the next
group whenever it holds fewer than generator.max_inflight_groups, steps the engine, and, between
engine steps, takes the weights the trainers broadcast: a thread receives each version into a
second copy while the engine generates, copied into the engine once whole
(generator.double_buffer_weights; without it, the rank polls a key in torchrun's store that
the trainers set before broadcasting, and receives between engine steps). The requests in
flight are not drained: their KV is recomputed with the new weights (generator.inflight_kv =
"recompute") or kept ("keep"), and every token carries the version that sampled it
(`Sample.versions`).

Batches: the training batch of step s is the first `share` groups (training.prompts_per_step
over the generator ranks) to finish, in completion order (groups finishing in one engine step in
their admission order). Completion order depends on timing, so two runs need not sample the same
batches: unlike the other placements, a run is not bitwise reproducible. With
generator.batch_order = "admission" a batch is the next `share` groups in admission order, sent
once all of them finished: the other placements' batches, at the price of waiting for their
stragglers (later groups keep the engine busy meanwhile).

Staleness: algorithm.max_offpolicy_steps = k bounds the age of every token: the batch of step s
holds only tokens of versions >= s - 1 - k. A generator admits no group while its weights are
too old for the next batch, and drops (and samples again, with other seeds) a group admitted
before version s - 1 - k: the trainers refuse an older token (StalenessError) as they refuse an
older rollout in disaggregated placement. Dropping favours short samples of a long-tailed
prompt; its count is logged (continuous/dropped_groups) and is zero when k covers the tail.

Resume: group g of a generator's prompts is prompt g % share of step g // share + 1, as the
other placements number them. A checkpoint records which groups the trainers trained on; a
resumed run samples every other group again (those in flight when it stopped were discarded), in
order, each once.
"""

import asyncio
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from torchtitan_rl import platform, watchdog
from torchtitan_rl.checkpoint import TrainState
from torchtitan_rl.config import JobConfig
from torchtitan_rl.episodes import OpenTask
from torchtitan_rl.generator.stream import AsyncStream, RequestStream
from torchtitan_rl.loop import Hooks
from torchtitan_rl.placements.disaggregated import (
    DisaggregatedTrainer,
    GeneratorWorker,
    Topology,
    _generator_start,
    _send,
)
from torchtitan_rl.producer import check_rewards, engine_failure_at
from torchtitan_rl.types import Rollout, Rollouts
from torchtitan_rl.weight_sync.broadcast import StagedReceiver

WEIGHTS_KEY = "torchtitan_rl/continuous/weights/"
"""torchrun's store key that trainer rank 0 sets for each version before broadcasting it (and
for the version after the last when the run stops): a generator polls it between engine steps."""


def announce(version: int) -> None:
    """Trainer rank 0: version `version`'s broadcast (or a stop) follows."""
    dist.distributed_c10d._get_default_store().set(f"{WEIGHTS_KEY}{version}", "1")


def announced(version: int) -> bool:
    return dist.distributed_c10d._get_default_store().check([f"{WEIGHTS_KEY}{version}"])


@dataclass
class Cursor:
    """Which of a generator's groups the trainers trained on: every group below `below`, and
    those of `above` (sorted)."""

    below: int = 0
    above: list[int] = field(default_factory=list)

    def add(self, groups: list[int]) -> None:
        taken = sorted(set(self.above) | set(groups))
        while taken and taken[0] == self.below:
            taken.pop(0)
            self.below += 1
        self.above = taken

    @classmethod
    def of(cls, cursors: dict | None, shard: int) -> "Cursor":
        """Generator `shard`'s cursor in a checkpoint's TrainState.cursors (new if none)."""
        below, above = (cursors or {}).get(shard, (0, []))
        return cls(below, list(above))

    def untaken(self):
        """The groups not trained on yet, in order, without end."""
        group, above = self.below, set(self.above)
        while True:
            if group not in above:
                yield group
            group += 1


def next_batch(finished: list[int], running: list[int], share: int, order: str) -> list[int] | None:
    """The positions in `finished` (group numbers, in completion order) of the next batch of
    `share` groups, or None while it is not complete. "completion": the first to finish.
    "admission": the `share` lowest numbers held (finished or `running`), once all finished."""
    if order == "completion":
        return list(range(share)) if len(finished) >= share else None
    lowest = sorted(finished + running)[:share]
    where = {index: position for position, index in enumerate(finished)}
    if len(lowest) < share or any(index not in where for index in lowest):
        return None
    return [where[index] for index in lowest]


@dataclass
class Group:
    """A group admitted to the engine."""

    index: int
    version: int
    """The policy version when it was admitted: no token of it is older."""
    attempt: int
    task: asyncio.Task


class ContinuousWorker:
    """A generator-only rank of the continuous placement. Its engine, task side and weight
    receiver are a GeneratorWorker's (`worker`); its loop is its own."""

    def __init__(self, config: JobConfig, topology: Topology, task: OpenTask | None = None):
        self.config, self.topology = config, topology
        self.worker = GeneratorWorker(config, topology, task)
        self.producer, self.generator = self.worker.producer, self.worker.generator
        self.share = config.training.prompts_per_step // self.producer.shards
        self.capacity = config.generator.max_inflight_groups or 2 * self.share
        if config.generator.double_buffer_weights:
            self.worker.receiver = StagedReceiver(self.worker.receiver)
        self.stream = AsyncStream(RequestStream(self.generator))
        self.trainer = topology.trainer_of(dist.get_rank())
        self.prompts: dict[int, list] = {}
        self.busy_s = 0.0
        self.straddled = self.dropped = 0
        self.pending: list = []
        """Messages sent, their sends not yet waited for (disaggregated._send)."""

    def prompt(self, index: int):
        """Group `index`'s prompt and first seed."""
        step, position = divmod(index, self.share)
        if step + 1 not in self.prompts:
            self.prompts = {step + 1: self.producer.prompts(step + 1)}
        seed = self.producer.sampling_seed(step + 1) + position * self.config.generator.sampling.n
        return self.prompts[step + 1][position], seed

    async def sample_group(self, index: int, attempt: int) -> Rollouts:
        prompt, seed = self.prompt(index)
        sampling = self.config.generator.sampling
        # A group sampled again after a drop takes other seeds, its own for each attempt.
        seed = (seed + attempt * 2**50) % 2**62
        scored = await self.producer.episodes.run_group(
            self.stream, prompt, seed=seed, n=sampling.n, max_tokens=sampling.max_tokens
        )
        check_rewards(index // self.share + 1, scored.rewards_PN)
        return Rollouts(
            [prompt],
            scored.completions,
            scored.rewards_PN,
            env_s=scored.env_s,
            reward_parts_PN=scored.reward_parts_PN,
        )

    def weights_arrived(self) -> bool:
        """Whether the next version can be taken without waiting: received whole into the
        second copy, or (single buffer) announced, its broadcast following."""
        receiver = self.worker.receiver
        if isinstance(receiver, StagedReceiver):
            return receiver.ready()
        return announced(self.generator.policy_version + 1)

    def take_weights(self) -> None:
        self.straddled += self.stream.stream.straddling()
        self.worker.take_weights()

    def run(self) -> None:
        start = _generator_start(self.topology, self.producer)
        cursors = [None]
        dist.broadcast_object_list(cursors, self.topology.trainers[0])
        cursor = Cursor.of(cursors[0], self.producer.shard)
        self.worker.evaluations = []
        self.take_weights()  # the starting (or restored) weights
        asyncio.run(self._run(start, cursor))
        steps = self.config.training.steps
        while self.generator.policy_version < steps:  # the trainers' last broadcasts
            self.take_weights()
        self.worker.send_last(self.trainer, self.pending)
        self.generator.close()

    async def _run(self, start: int, cursor: Cursor) -> None:
        """Until the last step's batch is sent: take announced weights, send a batch when
        enough groups finished, admit groups, step the engine."""
        steps, k = self.config.training.steps, self.config.algorithm.max_offpolicy_steps
        self.untaken, self.again = cursor.untaken(), []
        self.running: list[Group] = []
        self.finished: list[tuple[Group, Rollouts]] = []
        order = self.config.generator.batch_order
        step, last_sent = start + 1, time.perf_counter()
        while step <= steps:
            if self.weights_arrived():
                self.take_weights()
            self.collect()
            self.expire(oldest=step - 1 - k)
            chosen = next_batch(
                [g.index for g, _ in self.finished],
                [g.index for g in self.running],
                self.share,
                order,
            )
            if chosen is not None:
                batch = [self.finished[i] for i in chosen]
                taken = set(chosen)
                self.finished = [f for i, f in enumerate(self.finished) if i not in taken]
                self.send(step, batch, time.perf_counter() - last_sent)
                step, last_sent = step + 1, time.perf_counter()
                continue
            while self.can_admit(step, k):
                self.admit()
            await asyncio.sleep(0)  # the groups submit their requests, environments answer
            if len(self.stream.stream):
                began = time.perf_counter()
                watchdog.mark(step, "generate")
                with engine_failure_at(f"step {step}"):
                    self.stream.step()
                self.busy_s += time.perf_counter() - began
            elif not self.running and not self.can_admit(step, k):
                self.take_weights()  # nothing can run until newer weights come
            elif not any(g.task.done() for g in self.running):
                await asyncio.sleep(0.001)  # environments are answering
        for group in self.running:
            group.task.cancel()
        await asyncio.gather(*(g.task for g in self.running), return_exceptions=True)

    def collect(self) -> None:
        """Move the groups that finished to `finished`, in admission order."""
        done = [g for g in self.running if g.task.done()]
        for group in done:
            self.running.remove(group)
            self.finished.append((group, group.task.result()))

    def expire(self, oldest: int) -> None:
        """Drop the groups admitted before version `oldest`, which no batch may take any
        more, and queue them to be sampled again (first, in order)."""
        expired = [g for g in self.running if g.version < oldest]
        expired += [g for g, _ in self.finished if g.version < oldest]
        if not expired:
            return
        for group in expired:
            group.task.cancel()
            self.again.append((group.index, group.attempt + 1))
        self.running = [g for g in self.running if g.version >= oldest]
        self.finished = [f for f in self.finished if f[0].version >= oldest]
        self.again.sort()
        self.dropped += len(expired)

    def can_admit(self, step: int, k: int) -> bool:
        """Whether a group admitted now may join a batch: it joins, if groups finish in their
        order, the batch after those held, which takes versions >= that step - 1 - k."""
        held = len(self.running) + len(self.finished)
        joins = step + held // self.share
        return held < self.capacity and self.generator.policy_version >= joins - 1 - k

    def admit(self) -> None:
        index, attempt = self.again.pop(0) if self.again else (next(self.untaken), 0)
        task = asyncio.ensure_future(self.sample_group(index, attempt))
        self.running.append(Group(index, self.generator.policy_version, attempt, task))

    def send(self, step: int, batch: list, wall_s: float) -> None:
        """Send the batch of `step` (its groups and the figures since the last) to the trainer."""
        rollouts = Rollouts.cat([r for _, r in batch])
        # Groups meet their environments concurrently, with each other and with the engine:
        # the batch's environment time is its slowest group's.
        rollouts.env_s = max(r.env_s for _, r in batch)
        versions = [
            v
            for _, r in batch
            for samples in r.completions.samples
            for s in samples
            for v in (s.versions or [])
            if v >= 0
        ]
        rollout = Rollout(
            step=step,
            version=min(versions, default=self.generator.policy_version),
            weights_sha256=None,
            rollouts=rollouts,
            reward_errors=self.producer.counted_reward_errors,
            generate_s=self.busy_s + rollouts.env_s,  # the trainers subtract env_s
            evaluations=self.worker.evaluations,
            stop_requested=watchdog.stop_requested(),
            groups=(self.producer.shard, [group.index for group, _ in batch]),
            figures={
                "continuous/generator_busy": self.busy_s / max(wall_s, 1e-9),
                "continuous/straddled_updates": float(self.straddled),
                "continuous/dropped_groups": float(self.dropped),
            },
        )
        self.worker.evaluations, self.busy_s, self.straddled, self.dropped = [], 0.0, 0, 0
        _send(rollout, self.trainer, self.pending)


class TrainerSide:
    """The continuous placement's part of the trainer ranks (disaggregated.ContinuousSide)."""

    def __init__(self, polled: bool = False):
        """`polled`: the generators poll for each broadcast (no second weight buffer)."""
        self.polled = polled

    def announce(self, version: int) -> None:
        if self.polled:
            announce(version)

    def figures(
        self, step: int, messages: list[Rollout], state: TrainState, group
    ) -> dict[str, float]:
        """The age of every sampled token (step - 1 - its version), the share of samples that
        straddle a weight update, and the generators' own figures, over every trainer rank;
        records the groups trained on in `state` (every trainer rank holds every cursor)."""
        ages, straddling, samples = [], 0, 0
        for message in messages:
            for group_samples in message.rollouts.completions.samples:
                for sample in group_samples:
                    versions = [v for v in sample.versions or [] if v >= 0]
                    ages += [step - 1 - v for v in versions]
                    straddling += len(set(versions)) > 1
                    samples += 1
        names = sorted(messages[0].figures)
        sums = torch.tensor(
            [float(sum(ages)), float(len(ages)), float(straddling), float(samples)]
            + [float(len(messages))]
            + [sum(m.figures[name] for m in messages) for name in names],
            dtype=torch.float64,
        )
        platform.all_reduce_host(sums, group=group)
        worst = torch.tensor([float(max(ages, default=0))])
        platform.all_reduce_host(worst, op=dist.ReduceOp.MAX, group=group)
        every = platform.all_gather_objects([m.groups for m in messages], group=group)
        for shard, groups in (g for rank_groups in every for g in rank_groups):
            cursor = Cursor.of(state.cursors, shard)
            cursor.add(groups)
            state.cursors[shard] = (cursor.below, cursor.above)
        trained = sum(below + len(above) for below, above in state.cursors.values())
        figures = {
            "continuous/groups_trained": float(trained),
            "policy_age/token_mean": float(sums[0] / max(float(sums[1]), 1.0)),
            "policy_age/token_max": float(worst[0]),
            "continuous/straddling_share": float(sums[2] / max(float(sums[3]), 1.0)),
        }
        for name, total in zip(names, sums[5:].tolist(), strict=True):
            # Busy fractions average over the generators; counts add up.
            figures[name] = total / float(sums[4]) if name.endswith("_busy") else total
        return figures


def run(config: JobConfig, hooks: Hooks | None = None, task: OpenTask | None = None) -> None:
    """Every rank of a continuous run: build the topology (disaggregated placement's), then
    train or generate (with `task` opened, or opening it when None)."""
    topology = Topology.build(config)
    if dist.get_rank() in topology.generators:
        ContinuousWorker(config, topology, task).run()
    else:
        side = TrainerSide(polled=not config.generator.double_buffer_weights)
        DisaggregatedTrainer(config, topology, hooks, task, continuous=side).train()
