"""RLTrainer: the colocated, synchronous GRPO loop, readable top to bottom.

    torchrun --nproc_per_node 2 -m torchtitan_rl.train --job.config_file run_configs/debug_cpu.toml

Every rank holds a shard of the policy (PolicyTrainer) and a full generator replica
(Generator). A step: this rank's prompts -> n samples each -> rewards -> group advantages ->
one optimizer step over every rank's samples -> weight sync -> metrics. Shapes: P prompts on
this rank, N samples per prompt, B = P * N sequences, T tokens.
"""

import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from tokenizers import Tokenizer

from torchtitan_rl import batch_invariant, platform
from torchtitan_rl.algorithms import build_advantage, build_loss
from torchtitan_rl.batch import RolloutBatch, rollout_batch
from torchtitan_rl.checkpoint import (
    Checkpointer,
    CheckpointError,
    TrainState,
    export_hf,
    run_facts,
)
from torchtitan_rl.config.job_config import ConfigError, JobConfig
from torchtitan_rl.generator.engine import Completions, Generator
from torchtitan_rl.metrics import MetricsLogger
from torchtitan_rl.tasks import Prompt, build_task
from torchtitan_rl.tasks.rewards import RewardError, Scorer, load_reward_fn
from torchtitan_rl.trainer.policy_trainer import NonFiniteError, PolicyTrainer, check_finite
from torchtitan_rl.weight_sync import SyncStats, WeightSync, WeightSyncError


class InvarianceError(RuntimeError):
    """Batch-invariant mode is on, yet trainer and generator logprobs differ."""


# Errors that stop a run with one line naming the step and the cause.
StopRun = (NonFiniteError, RewardError, WeightSyncError, CheckpointError, InvarianceError)


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


class RLTrainer:
    """Owns the policy trainer, the generator, weight sync, the task and the metrics."""

    def __init__(self, config: JobConfig, hooks: Hooks | None = None):
        self.config = config
        self.hooks = hooks or Hooks()
        self.rank = dist.get_rank()
        self.group = None  # the ranks that train: all of them, colocated
        # This rank's share of the prompts: one of `shards` (every rank generates, colocated).
        self.shard, self.shards = self.rank, dist.get_world_size()
        if config.batch_invariant:
            batch_invariant.enable()  # before any model or engine is built
        torch.manual_seed(config.job.seed)
        sampling = config.generator.sampling
        # First, so that a wrong checkpoint folder fails before anything is built.
        self.checkpointer = Checkpointer(
            config.checkpoint, config.job.dump_folder, run_facts(config)
        )
        resume_path = self.checkpointer.find()
        # Before any model or engine: a bad dataset row fails in seconds, naming file:line.
        self.build_task()

        self.trainer = self.policy()
        # The frozen reference for the KL penalty: the starting policy, sharded like it, never
        # stepped (its optimizer state is never allocated). Built only when it is used.
        self.reference = self.policy() if config.algorithm.kl_beta > 0 else None
        self.generator = Generator(
            generator=config.generator, model=config.model, seed=config.job.seed + self.rank
        )
        self.weight_sync = WeightSync.between(
            self.trainer,
            self.generator,
            bucket_mb=config.generator.weight_sync_bucket_mb,
            verify=config.generator.verify_weight_sync,
        )
        self.loss = build_loss(config.algorithm, max_tokens=sampling.max_tokens)
        self.state = TrainState()
        self.checkpointer.attach(self.trainer, self.state)
        # Before the first generation: the restored weights go to the generator too.
        self.start_step = self.resume(resume_path)
        self.build_metrics(enabled=self.rank == 0)

    def policy(self, group: dist.ProcessGroup | None = None) -> PolicyTrainer:
        """A policy sharded over `group` (default: the world), from the run's HF checkpoint."""
        config = self.config
        return PolicyTrainer(
            model=config.model,
            training=config.training,
            parallelism=config.parallelism,
            temperature=config.generator.sampling.temperature,
            seed=config.job.seed,
            dump_folder=config.job.dump_folder,
            group=group,
        )

    def build_task(self) -> None:
        """Tokenizer, prompts, rewards and advantages."""
        config = self.config
        self.tokenizer = Tokenizer.from_file(
            str(Path(config.model.tokenizer_dir) / "tokenizer.json")
        )
        # Padding follows every real token of a right-padded causal batch and is masked out of
        # the loss, so any valid id serves.
        self.pad_id = 0
        self.task = build_task(config.task, seed=config.job.seed)
        reward_fn = load_reward_fn(config.task.reward_fn) if config.task.reward_fn else None
        self.scorer = Scorer(
            self.task, reward_fn, config.task.reward_on_error, config.task.reward_timeout_s
        )
        self.advantage = build_advantage(config.algorithm.advantage)
        self.encode(self.task.every_prompt())  # the longest prompt fits, or one line says not

    def build_metrics(self, enabled: bool) -> None:
        config = self.config
        self.metrics = MetricsLogger(
            config.job.dump_folder,
            enabled=enabled,
            total_steps=config.training.steps,
            log_interval=config.metrics.log_interval,
            tensorboard=config.metrics.enable_tensorboard,
            wandb_project=config.metrics.wandb_project if config.metrics.enable_wandb else None,
            run_config=asdict(config),
            resume_step=self.start_step,
        )

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
        for step in range(self.start_step + 1, steps + 1):
            self.train_step(step)
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

    def export_hf(self, out: Path) -> None:
        """The current policy as an HF safetensors folder (every rank calls; rank 0 writes)."""
        model = self.config.model
        export_hf(
            self.trainer.model.state_dict(),
            self.trainer.spec,
            model.hf_checkpoint,
            model.tokenizer_dir,
            out,
        )
        if self.rank == 0:
            print(f"exported the policy to {out}", flush=True)

    def train_step(self, step: int) -> dict[str, float]:
        self.hooks.before_step(step)
        start = time.perf_counter()
        prompts = self.my_prompts(step)
        prompt_ids = self.encode(prompts)
        completions = self.generator.generate(prompt_ids, seed=self.sampling_seed(step))
        self.generator.release_memory()  # generator.enable_sleep_mode: the trainer gets it
        generated = time.perf_counter()

        rewards_PN = self.score(step, prompts, completions)
        advantages = self.advantage(rewards_PN)
        logprob_diff, train_metrics = self.learn(
            step,
            prompts,
            completions,
            rewards_PN,
            advantages.values_PN,
            advantages.zero_variance_PN,
        )
        trained = time.perf_counter()
        self.hooks.after_train(step, train_metrics)

        self.generator.reclaim_memory()
        sync_stats = self.weight_sync.sync(self.trainer, self.generator)
        synced = time.perf_counter()
        self.hooks.after_sync(step, sync_stats)

        metrics = {
            **self.rollout_metrics(rewards_PN, advantages.zero_variance_PN, completions),
            **logprob_diff,
            **self.train_summary(train_metrics),
            "policy_version": float(self.generator.policy_version),
            "batch_invariant": float(batch_invariant.is_enabled()),
            "time/generate_s": generated - start,
            "time/train_s": trained - generated,
            "time/weight_sync_s": synced - trained,
            "time/step_s": synced - start,
        }
        metrics["throughput/generated_tokens_per_s"] = metrics["generated_tokens"] / (
            generated - start
        )
        self.metrics.log(step, metrics)
        self.hooks.after_step(step, metrics)
        return metrics

    def learn(
        self,
        step: int,
        prompts: list[Prompt],
        completions: Completions,
        rewards_PN: torch.Tensor,
        advantages_PN: torch.Tensor,
        zero_variance_PN: torch.Tensor,
    ) -> tuple[dict[str, float], dict[str, float]]:
        """Scored samples -> RolloutBatch -> one optimizer step; returns the logprob_diff
        metrics and the trainer's step metrics. The ranks of a TP group train on the union of
        their samples (each generated its own share)."""
        if self.trainer.tp_group is not None:
            shares = platform.all_gather_objects(
                (prompts, completions, rewards_PN, advantages_PN, zero_variance_PN),
                group=self.trainer.tp_group,
            )
            prompts = [p for share in shares for p in share[0]]
            completions = Completions(
                prompts=[p for share in shares for p in share[1].prompts],
                samples=[g for share in shares for g in share[1].samples],
            )
            rewards_PN, advantages_PN, zero_variance_PN = (
                torch.cat([share[i] for share in shares]) for i in (2, 3, 4)
            )
        batch = rollout_batch(
            completions.prompts,
            [[s.token_ids for s in group] for group in completions.samples],
            [[s.logprobs for s in group] for group in completions.samples],
            advantages_PN,
            self.pad_id,
        )
        if self.config.algorithm.filter_zero_variance_groups:
            keep_B = (~zero_variance_PN).reshape(-1, 1).float()
            batch.loss_mask_BT = batch.loss_mask_BT * keep_B
        check_finite(step, "generator", batch.generator_logprobs_BT, batch.loss_mask_BT.bool())
        if self.reference is not None:
            batch.reference_logprobs_BT, _ = self.reference.logprobs(batch.tokens_BT)
        # The trainer's pre-update logprobs come from the step's own forward: no extra pass.
        result = self.trainer.train_step(batch, self.loss)
        batch = batch.to(result.logprobs_BT.device)
        logprob_diff = self.logprob_diff(step, batch, result.logprobs_BT)
        self.log_rollouts(step, prompts, completions, rewards_PN, batch, result.logprobs_BT)
        return logprob_diff, result.metrics

    def train_summary(self, train_metrics: dict[str, float]) -> dict[str, float]:
        """The logged metrics of one optimizer step."""
        tokens = max(train_metrics["tokens"], 1)
        summary = {
            "loss": train_metrics["loss"],
            "entropy": train_metrics["entropy"],
            "grad_norm": train_metrics["grad_norm"],
            "lr": train_metrics["lr"],
            "clip_fraction": train_metrics["clipped_tokens"] / tokens,
        }
        if self.reference is not None:
            summary["kl"] = train_metrics["kl_sum"] / tokens
        return summary

    def my_prompts(self, step: int) -> list[Prompt]:
        """This rank's contiguous shard of the step's global prompts."""
        per_shard = self.config.training.prompts_per_step // self.shards
        prompts = self.task.prompts(step, per_shard * self.shards)
        return prompts[self.shard * per_shard : (self.shard + 1) * per_shard]

    def encode(self, prompts: list[Prompt]) -> list[list[int]]:
        ids = [self.tokenizer.encode(p.text).ids for p in prompts]
        limit = self.config.training.max_prompt_len
        for prompt, tokens in zip(prompts, ids, strict=True):
            where = f"{prompt.source}: " if prompt.source else ""
            if not tokens:
                raise ConfigError(
                    f"{where}prompt {prompt.text[:40]!r} encodes to no tokens with "
                    f"{self.config.model.tokenizer_dir}/tokenizer.json: fix the prompt or "
                    "use the tokenizer the model was trained with"
                )
            if len(tokens) > limit:
                raise ConfigError(
                    f"{where}prompt {prompt.text[:40]!r} has {len(tokens)} tokens, more than "
                    f"training.max_prompt_len = {limit}: raise it or shorten the prompt"
                )
        return ids

    def sampling_seed(self, step: int) -> int:
        # Per-request seeds: samples depend on (seed, step, shard, prompt), not on batching.
        # Each (step, shard) owns 2**20 consecutive seeds, one per sample (Generator.generate).
        run = (self.config.job.seed * 1_000_003 + step) * 4_096 + self.shard
        return run * 2**20 % 2**62

    def score(self, step: int, prompts: list[Prompt], completions: Completions) -> torch.Tensor:
        """Rewards [P, N] of every sample; a NaN/inf reward stops the run."""
        rewards = [
            [self.scorer(prompt, self.tokenizer.decode(s.token_ids)) for s in group]
            for prompt, group in zip(prompts, completions.samples, strict=True)
        ]
        rewards_PN = torch.tensor(rewards, dtype=torch.float32)
        if not bool(torch.isfinite(rewards_PN).all()):
            raise NonFiniteError(f"step {step}: a reward is not finite: {rewards_PN.tolist()}")
        return rewards_PN

    def logprob_diff(
        self, step: int, batch: RolloutBatch, trainer_BT: torch.Tensor
    ) -> dict[str, float]:
        """|generator - trainer| logprob of the sampled tokens before the update (all ranks).

        Under batch-invariant mode any difference means the mode no longer holds: the run stops
        (or warns, `batch_invariant_on_mismatch`) naming the step and the first such token.
        """
        mask_BT = batch.loss_mask_BT.bool()
        log_ratio_BT = trainer_BT - batch.generator_logprobs_BT
        diff_BT = log_ratio_BT.abs() * mask_BT
        # The importance ratio pi_trainer / pi_generator of the sampled tokens: exactly 1 where
        # the two sides agree bit for bit (batch-invariant mode). Max of (max, -min).
        ratio_BT = torch.exp(log_ratio_BT)
        total = torch.stack([diff_BT.sum(), mask_BT.sum()]).double().cpu()
        extremes = torch.stack(
            [
                diff_BT.max(),
                ratio_BT.masked_fill(~mask_BT, 1.0).max(),
                -ratio_BT.masked_fill(~mask_BT, 1.0).min(),
            ]
        ).cpu()
        platform.all_reduce_host(total, group=self.group)
        platform.all_reduce_host(extremes, op=dist.ReduceOp.MAX, group=self.group)
        metrics = {
            "logprob_diff/max": float(extremes[0]),
            "logprob_diff/mean": float(total[0] / total[1].clamp(min=1)),
            "behavior_ratio/max": float(extremes[1]),
            "behavior_ratio/min": -float(extremes[2]),
        }
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
            print(f"warning: {message}", flush=True)

    def log_rollouts(
        self,
        step: int,
        prompts: list[Prompt],
        completions: Completions,
        rewards_PN: torch.Tensor,
        batch: RolloutBatch,
        trainer_logprobs_BT: torch.Tensor,
        count: int = 4,
    ) -> None:
        """Every metrics.rollout_log_interval steps: the first sample of a few prompts."""
        interval = self.config.metrics.rollout_log_interval
        if interval == 0 or step % interval:
            return
        n = len(completions.samples[0])
        samples = []
        for p, prompt in enumerate(prompts[:count]):
            sample = completions.samples[p][0]
            row = p * n  # batch rows are prompt-major
            sampled = batch.loss_mask_BT[row].bool()
            diffs = trainer_logprobs_BT[row][sampled] - batch.generator_logprobs_BT[row][sampled]
            samples.append(
                {
                    "prompt": prompt.text,
                    "completion": self.tokenizer.decode(sample.token_ids),
                    "reward": float(rewards_PN[p, 0]),
                    "token_ids": sample.token_ids,
                    "generator_logprobs": sample.logprobs,
                    "logprob_diff": diffs.tolist(),
                }
            )
        self.metrics.log_rollouts(step, samples)

    def rollout_metrics(
        self,
        rewards_PN: torch.Tensor,
        zero_variance_PN: torch.Tensor,
        completions: Completions,
        errors: int | None = None,
    ) -> dict[str, float]:
        """Reward and length statistics over every rank's samples. `errors`: the reward-error
        count, when this rank's scorer does not hold it."""
        lengths = [len(s.token_ids) for group in completions.samples for s in group]
        sums = torch.tensor(
            [
                float(rewards_PN.sum()),
                float((rewards_PN**2).sum()),
                float(rewards_PN.numel()),
                float(sum(lengths)),
                float(zero_variance_PN[:, 0].sum()),
                float(rewards_PN.shape[0]),
                float(self.scorer.errors if errors is None else errors),
            ],
            dtype=torch.float64,
        )
        platform.all_reduce_host(sums, group=self.group)
        reward_sum, reward_sq, samples, tokens, flat_groups, groups, errors = sums.tolist()
        mean = reward_sum / samples
        return {
            "reward/mean": mean,
            "reward/std": max(reward_sq / samples - mean**2, 0.0) ** 0.5,
            "response_length/mean": tokens / samples,
            "zero_variance_groups/fraction": flat_groups / groups,
            "reward/errors": errors,
            "generated_tokens": tokens,
        }
