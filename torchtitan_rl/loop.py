"""The RL loop: one `train()` for every placement, the hooks it calls, and its metrics row.

    torchrun --nproc_per_node 2 -m torchtitan_rl.train --job.config_file run_configs/debug_cpu.toml

A run wires three parts: a RolloutProducer (task -> episodes -> scored rollouts,
producer.py), a Learner (advantages, loss, optimizer steps, learner.py) and a weight transport
(weight_sync/). The placement (placements/) decides where they run: colocated, every rank
generating with its own engine and then training its shard of the policy; disaggregated,
generator ranks apart from trainer ranks; or continuous, generator ranks that never drain and
take weights in flight. All run `train()` below (steps, evaluations, checkpoints, the HF
export) and log one row of metrics per step (`step_metrics`).
"""

from pathlib import Path
from typing import Protocol

import torch.distributed as dist

from torchtitan_rl import batch_invariant, watchdog
from torchtitan_rl.checkpoint import Checkpointer
from torchtitan_rl.config import ConfigError, JobConfig
from torchtitan_rl.config.manager import import_spec
from torchtitan_rl.hf_export import export_policy
from torchtitan_rl.learner import Learner
from torchtitan_rl.metrics import MetricsLogger
from torchtitan_rl.weight_sync import SyncStats


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
            "subclass torchtitan_rl.loop.Hooks"
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
    if "trained_tokens" in metrics:
        metrics["throughput/trained_tokens_per_s"] = metrics["trained_tokens"] / max(
            seconds["train"], 1e-9
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
