"""The colocated placement (RLTrainer): every rank generates its share of a step with its own
engine, then trains its shard of the policy on every rank's samples, then copies the weights
into its engine in place.

    torchrun --nproc_per_node 2 -m torchtitan_rl.train --job.config_file run_configs/debug_cpu.toml

A step: this rank's prompts -> n samples each -> rewards -> group advantages -> one optimizer
step over every rank's samples -> weight sync -> metrics.
"""

import time
from pathlib import Path

import torch
import torch.distributed as dist

from torchtitan_rl import batch_invariant, platform, watchdog
from torchtitan_rl.checkpoint import Checkpointer, TrainState, run_facts
from torchtitan_rl.config import JobConfig
from torchtitan_rl.episodes import OpenTask, open_task
from torchtitan_rl.evaluation import log_eval
from torchtitan_rl.generator.engine import LocalGenerator
from torchtitan_rl.learner import Learner, rollout_metrics
from torchtitan_rl.loop import Hooks, step_metrics, train
from torchtitan_rl.metrics import run_metrics
from torchtitan_rl.producer import RolloutProducer
from torchtitan_rl.weight_sync import transport


class RLTrainer:
    """The colocated placement: every rank holds a shard of the policy (FSDP/TP) and a whole
    generator, and copies its weights into it in place after every optimizer step."""

    def __init__(self, config: JobConfig, hooks: Hooks | None = None, task: OpenTask | None = None):
        """`task`: the run's task, opened (the launcher opens it once); None opens it here."""
        self.config = config
        self.hooks = hooks or Hooks()
        self.rank, self.group = dist.get_rank(), None  # every rank trains
        if config.batch_invariant:
            batch_invariant.enable_for(config)  # before any model or engine is built
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
        self.generator = LocalGenerator(
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
        # The run's count (every rank's) goes on in rank 0's; the metric adds up the ranks'.
        self.producer.reward_errors = self.state.reward_errors if self.rank == 0 else 0
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
        # The run's count, every rank's, its evaluations' included (the metric's comes before).
        count = torch.tensor([self.producer.counted_reward_errors])
        platform.all_reduce_host(count, group=self.group)
        self.state.reward_errors = int(count)

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


def run(config: JobConfig, hooks: Hooks | None = None, task: OpenTask | None = None) -> None:
    """Every rank of a colocated run."""
    trainer = RLTrainer(config, hooks, task)
    trainer.train()
    trainer.generator.close()  # not left to vLLM's teardown (platform.shutdown_distributed)
