"""The RL loop: one `train()` for every placement, and the colocated placement (RLTrainer).

    torchrun --nproc_per_node 2 -m torchtitan_rl.train --job.config_file run_configs/debug_cpu.toml

A run wires three parts: a RolloutProducer (task -> episodes -> scored rollouts,
producer.py), a Learner (advantages, loss, optimizer steps, learner.py) and a weight transport
(weight_sync/). The placement decides where they run: colocated here, every rank generating
with its own engine and then training its shard of the policy; or disaggregated
(disaggregated.py), generator ranks apart from trainer ranks. Both run `train()` below (steps,
evaluations, checkpoints, the HF export) and log one row of metrics per step (`step_metrics`).
A colocated step: this rank's prompts -> n samples each -> rewards -> group advantages -> one
optimizer step over every rank's samples -> weight sync -> metrics.
"""

import time
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

from torchtitan_rl import batch_invariant, watchdog
from torchtitan_rl.checkpoint import Checkpointer, TrainState, run_facts
from torchtitan_rl.config import ConfigError, JobConfig
from torchtitan_rl.config.manager import import_spec
from torchtitan_rl.episodes import OpenTask, open_task
from torchtitan_rl.evaluation import log_eval
from torchtitan_rl.generator.engine import Generator
from torchtitan_rl.hf_export import export_policy
from torchtitan_rl.learner import Learner, rollout_metrics
from torchtitan_rl.metrics import MetricsLogger, run_metrics
from torchtitan_rl.producer import RolloutProducer
from torchtitan_rl.weight_sync import SyncStats, transport


class Hooks:
    """Attach points for schedulers and user code; the default does nothing."""

    def before_step(self, step: int) -> None:
        pass

    def after_train(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def after_sync(self, step: int, stats: SyncStats) -> None:
        pass

    def after_step(self, step: int, metrics: dict[str, float]) -> None:
        pass


def load_hooks(config: JobConfig) -> Hooks:
    """The Hooks of job.hooks ('module:Class', built with the JobConfig), or the default."""
    if config.job.hooks is None:
        return Hooks()
    cls = import_spec(config.job.hooks, "job.hooks", "class")
    try:
        hooks = cls(config)
    except Exception as e:  # the user's constructor: say which and how it failed
        raise ConfigError(
            f"job.hooks = {config.job.hooks!r}: {cls.__name__}(config) raised {e!r}"
        ) from None
    missing = [name for name in vars(Hooks) if name[0] != "_" and not hasattr(hooks, name)]
    if missing:
        raise ConfigError(
            f"job.hooks = {config.job.hooks!r}: {cls.__name__} has no {', '.join(missing)}; "
            "subclass torchtitan_rl.rl_trainer.Hooks"
        )
    return hooks


# The metrics only some placements log; all log every other name (a test compares the key sets
# of a colocated and a disaggregated run: tests/integration/test_disaggregated.py).
PLACEMENT_METRICS = {
    "colocated": (),
    "disaggregated": (
        "policy_age/mean",
        "policy_age/max",
        "rollout_version/min",
        "time/wait_rollout_s",
    ),
    "continuous": (
        "policy_age/mean",
        "policy_age/max",
        "rollout_version/min",
        "time/wait_rollout_s",
        "policy_age/token_mean",
        "policy_age/token_max",
        "continuous/straddling_share",
        "continuous/groups_trained",
        "continuous/generator_busy",
        "continuous/straddled_updates",
        "continuous/dropped_groups",
    ),
}


def step_metrics(
    rollouts: dict[str, float],
    learned: dict[str, float],
    placement: dict[str, float],
    *,
    version: int,
    seconds: dict[str, float],
    sync: SyncStats,
    verified: float | None,
) -> dict[str, float]:
    """A step's row of metrics: the rollouts' and the learner's, then `placement`'s own
    (PLACEMENT_METRICS), the step's times (`seconds`: generate, env, train, weight_sync, step)
    and the weight sync's figures; weight_sync/verified with generator.verify_weight_sync."""
    metrics = {
        **rollouts,
        **learned,
        "policy_version": float(version),
        **placement,
        "batch_invariant": float(batch_invariant.is_enabled()),
        **{f"time/{name}_s": value for name, value in seconds.items()},
        "weight_sync/gb_per_s": sync.gb_per_s,
        "weight_sync/bytes": float(sync.bytes),
    }
    if verified is not None:
        metrics["weight_sync/verified"] = verified
    metrics["throughput/generated_tokens_per_s"] = metrics["generated_tokens"] / max(
        seconds["generate"], 1e-9
    )
    return metrics


class Placement(Protocol):
    """What `train()` drives: a placement's trainer side."""

    config: JobConfig
    learner: Learner
    checkpointer: Checkpointer
    metrics: MetricsLogger
    start_step: int
    group: dist.ProcessGroup | None
    """The trainer ranks (None: the world)."""

    def begin(self) -> None:
        """Before the first step: the starting weights out, the starting policy evaluated."""

    def train_step(self, step: int) -> dict[str, float]:
        """One RL step; returns the metrics it logged."""

    def after_step(self, step: int) -> None:
        """The evaluations due after `step`, and the train state a checkpoint saves."""

    def end(self) -> None:
        """After the last step, before the final checkpoint closes."""

    def stop(self, step: int) -> None:
        """The run stops after `step` (preempted), its checkpoint written."""


def train(run: Placement) -> None:
    """Every placement's loop: its steps, each followed by evaluation and a checkpoint when
    due (or when a signal asks the run to stop: watchdog.py); then the HF export
    (checkpoint.export_hf_at_end) and the metrics' close."""
    config, steps = run.config, run.config.training.steps
    run.begin()
    for step in range(run.start_step + 1, steps + 1):
        run.train_step(step)
        run.after_step(step)
        if watchdog.end_step(run.checkpointer, step, last=step == steps, group=run.group):
            run.stop(step)
            raise watchdog.Preempted(watchdog.preempted_line(run.checkpointer, step))
    watchdog.mark(steps, "end")
    run.end()
    run.checkpointer.close()
    if config.checkpoint.export_hf_at_end:
        out = Path(config.job.dump_folder) / "hf"
        export_policy(run.learner.trainer, config.model, out, run.group)
    run.metrics.close()


class RLTrainer:
    """The colocated placement: every rank holds a shard of the policy (FSDP/TP) and a whole
    generator, and copies its weights into it in place after every optimizer step."""

    def __init__(self, config: JobConfig, hooks: Hooks | None = None, task: OpenTask | None = None):
        """`task`: the run's task, opened (the launcher opens it once); None opens it here."""
        self.config = config
        self.hooks = hooks or Hooks()
        self.rank, self.group = dist.get_rank(), None  # every rank trains
        if config.batch_invariant:
            batch_invariant.enable()  # before any model or engine is built
        torch.manual_seed(config.job.seed)
        # First, so that a wrong checkpoint folder fails before anything is built.
        self.checkpointer = Checkpointer(
            config.checkpoint, config.job.dump_folder, run_facts(config)
        )
        resume_path = self.checkpointer.find()
        # Before any model or engine: a bad dataset row fails in seconds, naming file:line.
        task = task or open_task(config)
        # Every rank generates: its engine's share of the prompts (an engine per rank, or per
        # generator TP group), then trains on its part of them.
        self.producer = RolloutProducer(config, task, self.rank, dist.get_world_size())
        self.learner = Learner(config, task.renderer_of)
        self.generator = Generator(
            generator=config.generator,
            model=config.model,
            seed=config.job.seed + self.producer.shard,
        )
        self.transport = transport(config, self.learner.trainer, self.generator)
        self.state = TrainState()
        self.checkpointer.attach(self.learner.trainer, self.state)
        # Before the first generation: the restored weights go to the generator too.
        self.start_step = self.resume(resume_path)
        self.metrics = run_metrics(config, enabled=self.rank == 0, resume_step=self.start_step)
        self.learner.metrics = self.metrics

    def resume(self, path: Path | None) -> int:
        """Load the checkpoint at `path`, if any, into both sides; returns its step."""
        if path is None:
            return 0
        step = self.checkpointer.load(path)
        self.producer.reward_errors = self.state.reward_errors
        self.transport.send(self.state.policy_version)
        return step

    def train(self) -> None:
        train(self)

    def begin(self) -> None:
        if self.start_step == 0:
            self.evaluate(0)

    def after_step(self, step: int) -> None:
        self.evaluate(step)
        self.state.step = step
        self.state.policy_version = step
        self.state.reward_errors = self.producer.reward_errors

    def end(self) -> None:
        pass

    def stop(self, step: int) -> None:
        self.transport.stop()

    def evaluate(self, step: int) -> dict[str, float] | None:
        """When due: evaluate the generator's policy (the weights after `step`) on every
        rank's shard of the eval set; rank 0 logs eval/* to metrics.jsonl and samples to
        eval.jsonl."""
        if not self.producer.eval_due(step):
            return None
        watchdog.mark(step, "eval")
        result = self.producer.evaluate(self.generator, step)
        return log_eval(self.metrics, step, [result], self.group)

    def train_step(self, step: int) -> dict[str, float]:
        watchdog.mark(step, "generate")
        self.hooks.before_step(step)
        start = time.perf_counter()
        rollouts = self.producer.rollouts(step, self.generator)
        self.generator.release_memory()  # generator.enable_sleep_mode: the trainer gets it
        generated = time.perf_counter()

        watchdog.mark(step, "train")
        learned = self.learner.learn(step, rollouts)
        trained = time.perf_counter()
        self.hooks.after_train(step, learned)

        watchdog.mark(step, "weight_sync")
        self.generator.reclaim_memory()
        sync = self.transport.send(step)  # the policy after step s is version s
        synced = time.perf_counter()
        self.hooks.after_sync(step, sync)

        seconds = {
            "generate": generated - start - rollouts.env_s,
            "env": rollouts.env_s,
            "train": trained - generated,
            "weight_sync": synced - trained,
            "step": synced - start,
        }
        metrics = step_metrics(
            rollout_metrics(self.config, rollouts, self.producer.counted_reward_errors, self.group),
            learned,
            {},
            version=step,
            seconds=seconds,
            sync=sync,
            # A copy that differs raised WeightSyncError already.
            verified=1.0 if self.transport.verify else None,
        )
        self.metrics.log(step, metrics)
        self.hooks.after_step(step, metrics)
        return metrics
