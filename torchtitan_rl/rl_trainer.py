"""RLTrainer: the colocated, synchronous GRPO loop, readable top to bottom.

    torchrun --nproc_per_node 2 -m torchtitan_rl.train --job.config_file run_configs/debug_cpu.toml

Every rank holds a shard of the policy (PolicyTrainer) and a full generator replica
(Generator). A step: this rank's prompts -> n samples each -> rewards -> group advantages ->
one optimizer step over every rank's samples -> weight sync -> metrics. Shapes: P prompts on
this rank, N samples per prompt, B = P * N sequences, T tokens.
"""

import time
from pathlib import Path

import torch
import torch.distributed as dist

from torchtitan_rl import batch_invariant, console, platform
from torchtitan_rl.algorithms import build_advantage, build_loss
from torchtitan_rl.algorithms.advantages import zero_variance_P
from torchtitan_rl.algorithms.dynamic_sampling import fill_informative
from torchtitan_rl.algorithms.losses import kl_penalty
from torchtitan_rl.algorithms.offpolicy import behaviour_metrics
from torchtitan_rl.algorithms.overlong import overlong_keep_PN, overlong_rewards
from torchtitan_rl.checkpoint import (
    Checkpointer,
    TrainState,
    export_policy,
    run_facts,
)
from torchtitan_rl.config.job_config import ConfigError, JobConfig
from torchtitan_rl.config.manager import import_spec
from torchtitan_rl.episodes import OpenTask, open_task
from torchtitan_rl.errors import StopRun
from torchtitan_rl.evaluation import all_reduce, build_evaluator
from torchtitan_rl.generator.engine import Generator
from torchtitan_rl.metrics import run_metrics
from torchtitan_rl.trainer.policy_trainer import (
    NonFiniteError,
    PolicyTrainer,
    StepResult,
    check_finite,
    optimizer_steps_per_step,
)
from torchtitan_rl.types import EvalShard, Prompt, RolloutBatch, Rollouts, rollout_batch
from torchtitan_rl.weight_sync import SyncStats, WeightSync


class InvarianceError(StopRun):
    """Batch-invariant mode is on, yet trainer and generator logprobs differ."""


# Errors that stop a run with one line naming the step and the cause.


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


class RLTrainer:
    """Owns the policy trainer, the generator, weight sync, the task and the metrics."""

    def __init__(self, config: JobConfig, hooks: Hooks | None = None, task: OpenTask | None = None):
        """`task`: the run's task, opened (the launcher opens it once); None opens it here."""
        self.config = config
        self.hooks = hooks or Hooks()
        self.rank = dist.get_rank()
        self.group = None  # the ranks that train: all of them, colocated
        # This rank's share of the prompts: one of `shards` (every rank generates, colocated).
        self.shard, self.shards = self.rank, dist.get_world_size()
        if config.batch_invariant:
            batch_invariant.enable()  # before any model or engine is built
        torch.manual_seed(config.job.seed)
        # First, so that a wrong checkpoint folder fails before anything is built.
        self.checkpointer = Checkpointer(
            config.checkpoint, config.job.dump_folder, run_facts(config)
        )
        resume_path = self.checkpointer.find()
        # Before any model or engine: a bad dataset row fails in seconds, naming file:line.
        self.build_task(task)

        self.trainer = self.policy()
        # The frozen reference for the KL penalty: the starting policy, sharded like it, never
        # stepped (its optimizer state is never allocated). Built only when it is used.
        self.reference = self.policy(trained=False) if config.algorithm.kl_beta > 0 else None
        self.generator = Generator(
            generator=config.generator, model=config.model, seed=config.job.seed + self.rank
        )
        self.weight_sync = WeightSync.between(
            self.trainer,
            self.generator,
            bucket_mb=config.generator.weight_sync_bucket_mb,
            verify=config.generator.verify_weight_sync,
        )
        self.loss = build_loss(config.algorithm, max_tokens=config.episode_tokens)
        self.state = TrainState()
        self.checkpointer.attach(self.trainer, self.state)
        # Before the first generation: the restored weights go to the generator too.
        self.start_step = self.resume(resume_path)
        self.build_metrics(enabled=self.rank == 0)

    def policy(self, group: dist.ProcessGroup | None = None, trained: bool = True) -> PolicyTrainer:
        """A policy sharded over `group` (default: the world), from the run's HF checkpoint;
        with the run's LoRA adapters when it is `trained` (the KL reference has none)."""
        config = self.config
        return PolicyTrainer(
            model=config.model,
            training=config.training,
            parallelism=config.parallelism,
            temperature=config.generator.sampling.temperature,
            seed=config.job.seed,
            dump_folder=config.job.dump_folder,
            group=group,
            lora=config.lora if trained else None,
        )

    def build_task(self, opened: OpenTask | None) -> None:
        """Prompts, their renderer, rewards, advantages and the evaluator, from the opened task
        (`episodes.open_task`, which reads and renders every dataset row; None: open it)."""
        config = self.config
        opened = opened or open_task(config)
        self.task, self.renderer, self.scorer = opened.task, opened.renderer, opened.scorer
        self.episodes = opened.episodes
        # Padding follows every real token of a right-padded causal batch and is masked out of
        # the loss, so any valid id serves.
        self.pad_id = 0
        self.advantage = build_advantage(config.algorithm.advantage)
        self.evaluator = build_evaluator(config, opened)

    def build_metrics(self, enabled: bool) -> None:
        self.metrics = run_metrics(self.config, enabled=enabled, resume_step=self.start_step)

    def resume(self, path: Path | None) -> int:
        """Load the checkpoint at `path`, if any, into both sides; returns its step."""
        if path is None:
            return 0
        step = self.checkpointer.load(path)
        self.scorer.errors = self.state.reward_errors
        self.weight_sync.sync(self.trainer, self.generator, version=self.state.policy_version)
        return step

    def train(self) -> None:
        steps = self.config.training.steps
        if self.evaluator is not None and self.start_step == 0 and self.evaluator.due(0, steps):
            self.evaluate(0)
        for step in range(self.start_step + 1, steps + 1):
            self.train_step(step)
            if self.evaluator is not None and self.evaluator.due(step, steps):
                self.evaluate(step)
            self.state.step = step
            self.state.policy_version = self.generator.policy_version
            self.state.reward_errors = self.scorer.errors
            if self.checkpointer.should_save(step, last=step == steps):
                self.checkpointer.save(step)
            self.checkpointer.poll()
        self.checkpointer.close()
        if self.config.checkpoint.export_hf_at_end:
            self.export_hf(Path(self.config.job.dump_folder) / "hf")
        self.metrics.close()

    def evaluate(self, step: int) -> dict[str, float]:
        """Evaluate the generator's policy (the weights after `step`) on every rank's shard of
        the eval set; rank 0 logs eval/* to metrics.jsonl and samples to eval.jsonl."""
        result = self.evaluator.run(self.generator, step, self.shard, self.shards)
        return self.log_eval(step, [result])

    def log_eval(self, step: int, shards: list[EvalShard]) -> dict[str, float]:
        """Sum the evaluations `shards` (this rank's) over the ranks, and log them at `step`."""
        result = EvalShard.merge(shards)
        all_reduce(result, self.group)
        metrics = result.metrics()
        self.metrics.log_eval(step, metrics, result.samples)
        return metrics

    def export_hf(self, out: Path) -> None:
        """The current policy as an HF safetensors folder (every rank calls; rank 0 writes)."""
        export_policy(self.trainer, self.config.model, out)

    def train_step(self, step: int) -> dict[str, float]:
        self.hooks.before_step(step)
        start = time.perf_counter()
        rollouts = self.rollouts(step)
        self.generator.release_memory()  # generator.enable_sleep_mode: the trainer gets it
        generated = time.perf_counter()

        learned = self.learn(step, rollouts)
        trained = time.perf_counter()
        self.hooks.after_train(step, learned)

        self.generator.reclaim_memory()
        sync_stats = self.weight_sync.sync(self.trainer, self.generator)
        synced = time.perf_counter()
        self.hooks.after_sync(step, sync_stats)

        metrics = {
            **self.rollout_metrics(rollouts),
            **learned,
            "policy_version": float(self.generator.policy_version),
            "batch_invariant": float(batch_invariant.is_enabled()),
            "time/generate_s": generated - start - rollouts.env_s,
            "time/env_s": rollouts.env_s,
            "time/train_s": trained - generated,
            "time/weight_sync_s": synced - trained,
            "time/step_s": synced - start,
            "weight_sync/bytes": float(sync_stats.bytes),
        }
        metrics["throughput/generated_tokens_per_s"] = (
            metrics["generated_tokens"] / metrics["time/generate_s"]
        )
        self.metrics.log(step, metrics)
        self.hooks.after_step(step, metrics)
        return metrics

    def rollouts(self, step: int) -> Rollouts:
        """This rank's prompts of the step, their episodes run and scored (tasks.episodes; one
        turn each for a single-turn task). With dynamic sampling, further rounds of prompts
        until the rank has as many groups with learning signal."""
        algorithm = self.config.algorithm
        sampling = self.config.generator.sampling
        rounds: list[Rollouts] = []
        for round in range(algorithm.max_generation_rounds):
            prompts = self.my_prompts(step, round)
            scored = self.episodes.run(
                self.generator,
                prompts,
                seed=self.sampling_seed(step, round),
                n=sampling.n,
                max_tokens=sampling.max_tokens,
            )
            check_rewards(step, scored.rewards_PN)
            rounds.append(
                Rollouts(prompts, scored.completions, scored.rewards_PN, env_s=scored.env_s)
            )
            if not algorithm.dynamic_sampling:
                return rounds[0]
            informative = sum(int((~zero_variance_P(r.rewards_PN)).sum()) for r in rounds)
            if informative >= len(prompts):
                break
        return fill_informative(rounds, wanted=len(rounds[0]))

    def learn(self, step: int, rollouts: Rollouts) -> dict[str, float]:
        """Scored samples -> advantages -> RolloutBatch -> training.mini_batches *
        training.epochs optimizer steps; returns the logprob, off-policy and training metrics.
        The ranks of a TP group train on the union of their samples (each generated its own
        share)."""
        algorithm = self.config.algorithm
        if self.trainer.tp_group is not None:
            shares = platform.all_gather_objects(rollouts, group=self.trainer.tp_group)
            rollouts = Rollouts.cat(shares)
        completions = rollouts.completions
        truncated_PN = rollouts.truncated_PN()
        rewards_PN = overlong_rewards(
            rollouts.rewards_PN,
            rollouts.lengths_PN(),
            truncated_PN,
            algorithm.overlong,
            self.config.episode_tokens,
            algorithm.overlong_buffer,
        )
        batch = rollout_batch(
            completions.prompts,
            completions.samples,
            torch.zeros_like(rewards_PN),
            self.pad_id,
        )
        check_finite(step, "generator", batch.generator_logprobs_BT, batch.loss_mask_BT.bool())
        metrics = {}
        if self.reference is not None:
            batch.reference_logprobs_BT, _ = self.reference.logprobs(batch.tokens_BT)
            if algorithm.kl_in_reward:
                penalty_B, metrics["kl"] = self.kl_in_reward(batch)
                rewards_PN = rewards_PN - algorithm.kl_beta * penalty_B.view_as(rewards_PN)
        if algorithm.overlong in ("zero_reward", "soft_penalty") or algorithm.kl_in_reward:
            # What the advantages see, beside the task's reward/mean.
            totals = torch.tensor(
                [float(rewards_PN.sum()), rewards_PN.numel()], dtype=torch.float64
            )
            platform.all_reduce_host(totals, group=self.group)
            metrics["reward/shaped_mean"] = float(totals[0] / totals[1])
        batch.advantages_B = self.advantage(rewards_PN).reshape(-1).float()
        keep_PN = overlong_keep_PN(truncated_PN, algorithm.overlong)
        if algorithm.filter_zero_variance_groups or algorithm.dynamic_sampling:
            keep_PN = keep_PN & ~zero_variance_P(rollouts.rewards_PN)[:, None]
        batch.loss_mask_BT = batch.loss_mask_BT * keep_PN.reshape(-1, 1)
        old_BT, results = self.update(step, batch)
        batch = batch.to(old_BT.device)
        metrics |= self.logprob_diff(step, batch, old_BT) | self.train_summary(results)
        self.log_rollouts(step, rollouts, batch, old_BT)
        return metrics

    def update(self, step: int, batch: RolloutBatch) -> tuple[torch.Tensor, list[StepResult]]:
        """training.epochs passes of training.mini_batches optimizer steps over `batch`, each
        pass shuffled; returns the policy's logprobs [B, T] before the first step (the "old"
        policy of the PPO ratio) and every step's result."""
        training = self.config.training
        if optimizer_steps_per_step(training) == 1:
            # The old logprobs are the step's own forward: no extra pass.
            result = self.trainer.optimizer_step(batch, self.loss, step=step)
            return result.logprobs_BT, [result]
        batch.old_logprobs_BT, _ = self.trainer.logprobs(batch.tokens_BT)
        # The same order on every rank of a TP group, which holds the same batch.
        shuffle = torch.Generator().manual_seed(self.config.job.seed * 1_000_003 + step)
        results = []
        for _ in range(training.epochs):
            order_B = torch.randperm(batch.batch_size, generator=shuffle)
            for rows in order_B.tensor_split(training.mini_batches):
                results.append(self.trainer.optimizer_step(batch.rows(rows), self.loss, step=step))
        return batch.old_logprobs_BT, results

    def kl_in_reward(self, batch: RolloutBatch) -> tuple[torch.Tensor, float]:
        """Each sequence's summed KL estimate [B] on the generator's logprobs (what the reward
        loses, times kl_beta), and its mean per token over every rank."""
        reference_BT = batch.reference_logprobs_BT
        mask_BT = batch.loss_mask_BT.to(reference_BT.device)
        kl_BT = kl_penalty(
            batch.generator_logprobs_BT.to(reference_BT.device),
            reference_BT,
            self.config.algorithm.kl_estimator,
        )
        per_sequence_B = (kl_BT * mask_BT).sum(dim=1)
        totals = torch.stack([per_sequence_B.sum(), mask_BT.sum()]).double().cpu()
        platform.all_reduce_host(totals, group=self.group)
        return per_sequence_B.cpu(), float(totals[0] / totals[1].clamp(min=1))

    def train_summary(self, results: list[StepResult]) -> dict[str, float]:
        """The logged metrics of a step's optimizer steps (means over them; fractions of the
        tokens they trained on)."""
        tokens = max(sum(r.metrics["tokens"] for r in results), 1)

        def total(name: str) -> float:
            return sum(r.metrics.get(name, 0.0) for r in results)

        summary = {
            "loss": total("loss") / len(results),
            "entropy": sum(r.metrics["entropy"] * r.metrics["tokens"] for r in results) / tokens,
            "grad_norm": total("grad_norm") / len(results),
            "lr": results[-1].metrics["lr"],
            "clip_fraction": total("clipped_tokens") / tokens,
            "optimizer_steps": float(len(results)),
        }
        if self.config.algorithm.clip_ratio_c > 0:
            summary["dual_clip_fraction"] = total("dual_clipped_tokens") / tokens
        if "kl_sum" in results[0].metrics:
            summary["kl"] = total("kl_sum") / tokens
        return summary

    def my_prompts(self, step: int, round: int = 0) -> list[Prompt]:
        """This rank's contiguous shard of the step's global prompts (of a dynamic-sampling
        `round` > 0: further ones)."""
        per_shard = self.config.training.prompts_per_step // self.shards
        prompts = self.task.prompts(step, per_shard * self.shards, round)
        return prompts[self.shard * per_shard : (self.shard + 1) * per_shard]

    def sampling_seed(self, step: int, round: int = 0) -> int:
        # Per-request seeds: samples depend on (seed, step, shard, prompt), not on batching.
        # Each (step, shard) owns 2**20 consecutive seeds, one per sample (Generator.generate);
        # a dynamic-sampling round takes the ones after the previous round's.
        run = (self.config.job.seed * 1_000_003 + step) * 4_096 + self.shard
        per_round = self.config.training.prompts_per_step // self.shards
        return (run * 2**20 + round * per_round * self.config.generator.sampling.n) % 2**62

    def logprob_diff(
        self, step: int, batch: RolloutBatch, trainer_BT: torch.Tensor
    ) -> dict[str, float]:
        """How far the generator's logprobs of the sampled tokens are from the trainer's before
        the update, over all ranks (`offpolicy.behaviour_metrics`).

        Under batch-invariant mode any difference means the mode no longer holds: the run stops
        (or warns, `batch_invariant_on_mismatch`) naming the step and the first such token.
        """
        metrics, diff_BT = behaviour_metrics(batch, trainer_BT, self.loss.correction, self.group)
        if batch_invariant.is_enabled() and metrics["logprob_diff/max"] != 0.0:
            self.invariance_broken(step, batch, trainer_BT, diff_BT, metrics["logprob_diff/max"])
        return metrics

    def invariance_broken(self, step, batch, trainer_BT, diff_BT, largest: float) -> None:
        """Batch-invariant mode promised equal logprobs and a step saw a difference: every rank
        raises (or warns) together; ranks that hold a differing token name the first one."""
        differing = diff_BT.nonzero()
        if len(differing):
            b, t = (int(i) for i in differing[0])
            trainer, generator = trainer_BT[b, t], batch.generator_logprobs_BT[b, t]
            where = (
                f"first on rank {self.rank}, sequence {b}, token {t}: trainer "
                f"{float(trainer)!r}, generator {float(generator)!r}"
            )
        else:
            where = "on another rank"
        message = (
            f"step {step}: batch_invariant = true but trainer and generator logprobs differ "
            f"(logprob_diff/max = {largest:.3g}, {where}); see README 'Batch-invariant mode' "
            "for the conditions, or set batch_invariant_on_mismatch = 'warn'"
        )
        if self.config.batch_invariant_on_mismatch == "fail":
            raise InvarianceError(message)
        if len(differing):
            console.say(f"warning: {message}")

    def log_rollouts(
        self,
        step: int,
        rollouts: Rollouts,
        batch: RolloutBatch,
        trainer_logprobs_BT: torch.Tensor,
        count: int = 4,
    ) -> None:
        """Every metrics.rollout_log_interval steps: the first sample of a few prompts."""
        interval = self.config.metrics.rollout_log_interval
        if interval == 0 or step % interval:
            return
        n = rollouts.rewards_PN.shape[1]
        samples = []
        for p, prompt in enumerate(rollouts.prompts[:count]):
            sample = rollouts.completions.samples[p][0]
            row = p * n  # batch rows are prompt-major
            sampled = batch.loss_mask_BT[row].bool()
            diffs = trainer_logprobs_BT[row][sampled] - batch.generator_logprobs_BT[row][sampled]
            samples.append(
                {
                    "prompt": self.renderer.text(prompt),
                    "completion": self.renderer.decode(sample.token_ids),
                    "messages": sample.messages,
                    "reward": float(rollouts.rewards_PN[p, 0]),
                    "token_ids": sample.token_ids,
                    "sampled_mask": sample.sampled_mask,
                    "generator_logprobs": sample.logprobs,
                    "logprob_diff": diffs.tolist(),
                }
            )
        self.metrics.log_rollouts(step, samples)

    def rollout_metrics(self, rollouts: Rollouts, errors: int | None = None) -> dict[str, float]:
        """Reward and length statistics over every rank's samples. `errors`: the reward-error
        count, when this rank's scorer does not hold it."""
        rewards_PN, completions = rollouts.rewards_PN, rollouts.completions
        samples = [s for group in completions.samples for s in group]
        sums = torch.tensor(
            [
                float(rewards_PN.sum()),
                float((rewards_PN**2).sum()),
                float(rewards_PN.numel()),
                float(completions.num_tokens),
                float(zero_variance_P(rollouts.rewards_PN).sum()),
                float(rewards_PN.shape[0]),
                float(self.scorer.errors if errors is None else errors),
                float(rollouts.rounds),
                float(rollouts.parts),
                float(rollouts.generated_groups or len(rollouts)),
                float(rollouts.short_groups),
                float(rollouts.truncated_PN().sum()),
                float(sum(s.turns for s in samples)),
                float(sum(s.tool_calls for s in samples)),
                float(sum(s.tool_errors for s in samples)),
            ],
            dtype=torch.float64,
        )
        platform.all_reduce_host(sums, group=self.group)
        longest = torch.tensor([float(max((s.sampled_tokens for s in samples), default=0))])
        platform.all_reduce_host(longest, op=dist.ReduceOp.MAX, group=self.group)
        reward_sum, reward_sq, samples, tokens, flat_groups, groups, errors, *rest = sums.tolist()
        *rounds, truncated, turns, tool_calls, tool_errors = rest
        mean = reward_sum / samples
        if self.config.algorithm.dynamic_sampling:
            rounds_sum, parts, generated, short = rounds
            metrics = {
                "dynamic_sampling/rounds": rounds_sum / parts,
                "dynamic_sampling/generated_groups": generated,
                "dynamic_sampling/short_groups": short,
            }
        else:
            metrics = {}
        return metrics | {
            "reward/mean": mean,
            "reward/std": max(reward_sq / samples - mean**2, 0.0) ** 0.5,
            "response_length/mean": tokens / samples,
            "response_length/max": float(longest[0]),
            "response/truncated_fraction": truncated / samples,
            "zero_variance_groups/fraction": flat_groups / groups,
            "reward/errors": errors,
            "generated_tokens": tokens,
            "env/turns": turns / samples,
            "env/tool_calls": tool_calls / samples,
            "env/tool_error_rate": tool_errors / max(tool_calls, 1.0),
        }


def check_rewards(step: int, rewards_PN: torch.Tensor) -> None:
    """A NaN/inf reward stops the run."""
    if not bool(torch.isfinite(rewards_PN).all()):
        raise NonFiniteError(f"step {step}: a reward is not finite: {rewards_PN.tolist()}")
