"""Learner: a step's scored Rollouts -> advantages -> RolloutBatch -> optimizer steps, and
the metrics of it; used alike by every placement's trainer ranks.

    .venv/bin/python -m pytest tests/unit/test_rl_trainer.py tests/unit/test_algorithms.py

Shapes: P prompts on this rank, N samples per prompt, B = P * N sequences, T tokens.
"""

import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist

from torchtitan_rl import batch_invariant, console, platform
from torchtitan_rl.algorithms.advantages import build_advantage, zero_variance_P
from torchtitan_rl.algorithms.losses import build_loss, kl_penalty
from torchtitan_rl.algorithms.offpolicy import behaviour_metrics
from torchtitan_rl.algorithms.overlong import overlong_keep_PN, overlong_rewards
from torchtitan_rl.config import JobConfig, ModelSection
from torchtitan_rl.errors import StopRun
from torchtitan_rl.metrics import MetricsLogger
from torchtitan_rl.tasks.render import Renderer
from torchtitan_rl.trainer.model import STUDENT
from torchtitan_rl.trainer.policy_trainer import (
    PolicyTrainer,
    StepResult,
    check_finite,
    optimizer_steps_per_step,
)
from torchtitan_rl.types import Prompt, RolloutBatch, Rollouts, rollout_batch


class InvarianceError(StopRun):
    """Batch-invariant mode is on, yet trainer and generator logprobs differ."""


def build_policy(
    config: JobConfig,
    group: dist.ProcessGroup | None = None,
    trained: bool = True,
    model: ModelSection | None = None,
) -> PolicyTrainer:
    """A policy sharded over `group` (default: the world), from the run's HF checkpoint (or
    `model`'s: a distill teacher's); with the run's LoRA adapters and router replay when it is
    `trained` (the KL reference and the teacher are frozen), scoring at the sampling
    temperature."""
    fields = STUDENT if model is None else ("distill.teacher_checkpoint", "distill.teacher_flavor")
    return PolicyTrainer(
        model=model or config.model,
        training=config.training,
        parallelism=config.parallelism,
        temperature=config.generator.sampling.temperature,
        seed=config.job.seed,
        dump_folder=config.job.dump_folder,
        group=group,
        lora=config.lora if trained else None,
        router_replay=trained and config.algorithm.router_replay,
        checkpoint_fields=fields,
    )


def build_teacher(config: JobConfig, group: dist.ProcessGroup | None = None) -> PolicyTrainer:
    """The [distill] teacher, frozen, sharded over `group` like the policy (so it may be larger
    than one rank holds)."""
    teacher = dataclasses.replace(
        config.model,
        flavor=config.distill.teacher_flavor or config.model.flavor,
        hf_checkpoint=config.distill.teacher_checkpoint,
    )
    return build_policy(config, group, trained=False, model=teacher)


class Learner:
    """The policy (`trainer`), the frozen KL reference (built only with a KL penalty), the
    distill teacher (only with one), the advantage estimator and the loss, over the trainer
    ranks `group` (None: the world)."""

    def __init__(self, config: JobConfig, renderer_of: Callable[[Prompt], Renderer], group=None):
        """`renderer_of(prompt)`: the renderer of the prompt's source (OpenTask.renderer_of),
        for the rollout log."""
        self.config, self.renderer_of, self.group = config, renderer_of, group
        self.trainer = build_policy(config, group)
        # The frozen reference for the KL penalty: the starting policy, sharded like it, never
        # stepped (its optimizer state is never allocated).
        self.reference = None
        if config.algorithm.kl_beta > 0:
            self.reference = build_policy(config, group, trained=False)
        self.teacher = build_teacher(config, group) if config.distill.enabled else None
        self.advantage = build_advantage(config.algorithm.advantage)
        self.loss = build_loss(
            config.algorithm, max_tokens=config.episode_tokens, distill=config.distill
        )
        # Padding follows every real token of a right-padded causal batch and is masked out of
        # the loss, so any valid id serves.
        self.pad_id = 0
        self.metrics: MetricsLogger | None = None
        """Where `log_rollouts` writes (set by the placement once it is built)."""
        self.routing = (0, 0)
        """(Mismatched, compared) (token, MoE layer) routing pairs of the step's old-policy
        pass against the generator's (`moe/routing_mismatch`)."""

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
            completions.images,
        )
        check_finite(step, "generator", batch.generator_logprobs_BT, batch.loss_mask_BT.bool())
        metrics = {}
        if self.reference is not None:
            # Only the sampled tokens' logprobs are read (packed, only those are computed).
            batch.reference_logprobs_BT, _ = self.reference.logprobs(
                batch.tokens_BT, batch.loss_mask_BT, images_B=batch.images_B
            )
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
        advantages_PN = self.advantage(rewards_PN)
        if self.teacher is not None:
            metrics |= self.distill(step, batch, rollouts, advantages_PN)
        batch.advantages_B = advantages_PN.reshape(-1).float()
        keep_PN = overlong_keep_PN(truncated_PN, algorithm.overlong)
        if algorithm.filter_zero_variance_groups or algorithm.dynamic_sampling:
            keep_PN = keep_PN & ~zero_variance_P(rollouts.rewards_PN)[:, None]
        batch.loss_mask_BT = batch.loss_mask_BT * keep_PN.reshape(-1, 1)
        old_BT, results = self.update(step, batch)
        batch = batch.to(old_BT.device)
        metrics |= self.logprob_diff(step, batch, old_BT) | self.routing_metrics()
        metrics |= self.train_summary(results)
        self.log_rollouts(step, rollouts, batch, old_BT)
        return metrics

    def distill(
        self, step: int, batch: RolloutBatch, rollouts: Rollouts, advantages_PN: torch.Tensor
    ) -> dict[str, float]:
        """The teacher's signal on the sampled tokens of the sources that learn from it: in
        mode advantage each token's advantage gains -coef * (generator - teacher logprob), in
        mode loss the loss's KL term takes the teacher's logprobs (the batch carries them in
        both modes, for the rollout log). The reward's advantages of sources that learn from
        the teacher alone are zeroed in place. Returns the distill/ figures over every rank
        (per sampled token of the distilled sources)."""
        distill = self.config.distill
        sources = self.config.task.named_sources
        learn_from = [sources[p.source].learn_from for p in rollouts.prompts]
        teacher_alone_P = torch.tensor([how == "teacher" for how in learn_from])
        advantages_PN[teacher_alone_P] = 0.0
        n = advantages_PN.shape[1]
        distilled_B = torch.tensor([how != "reward" for how in learn_from]).repeat_interleave(n)
        mask_BT = batch.loss_mask_BT * distilled_B[:, None]
        teacher_BT, _ = self.teacher.logprobs(batch.tokens_BT, mask_BT, images_B=batch.images_B)
        teacher_BT = teacher_BT.cpu() * mask_BT
        check_finite(step, "teacher", teacher_BT, mask_BT.bool())
        reverse_kl_BT = (batch.generator_logprobs_BT - teacher_BT) * mask_BT
        batch.teacher_logprobs_BT, batch.distilled_B = teacher_BT, distilled_B.float()
        if distill.mode == "advantage":
            batch.token_advantages_BT = -distill.coef * reverse_kl_BT
        return self.distill_metrics(
            rollouts, batch, reverse_kl_BT, teacher_BT, mask_BT, advantages_PN
        )

    def distill_metrics(
        self,
        rollouts: Rollouts,
        batch: RolloutBatch,
        reverse_kl_BT: torch.Tensor,
        teacher_BT: torch.Tensor,
        mask_BT: torch.Tensor,
        advantages_PN: torch.Tensor,
    ) -> dict[str, float]:
        """distill/reverse_kl and distill/teacher_logprob, means per distilled token (and per
        source in a mixture); where a source learns from both signals in mode advantage, the
        mean |advantage| per sampled token each gives: distill/advantage_reward and
        distill/advantage_teacher."""
        names = list(self.config.task.sources) or [""]
        source_B = torch.tensor([names.index(p.source) for p in rollouts.prompts])
        source_B = source_B.repeat_interleave(advantages_PN.shape[1])
        sums = []
        for s in range(len(names)):
            rows_B = source_B == s
            sums += [reverse_kl_BT[rows_B].sum(), teacher_BT[rows_B].sum(), mask_BT[rows_B].sum()]
        sampled_BT = batch.loss_mask_BT
        reward_BT = advantages_PN.reshape(-1, 1).abs() * sampled_BT
        teacher_advantage_BT = self.config.distill.coef * reverse_kl_BT.abs()
        sums += [reward_BT.sum(), teacher_advantage_BT.sum(), sampled_BT.sum()]
        totals = torch.stack([torch.as_tensor(x, dtype=torch.float64) for x in sums])
        platform.all_reduce_host(totals, group=self.group)
        per_source = totals[:-3].view(-1, 3)
        kl, teacher, tokens = per_source.sum(dim=0).tolist()
        metrics = {
            "distill/reverse_kl": kl / max(tokens, 1.0),
            "distill/teacher_logprob": teacher / max(tokens, 1.0),
        }
        if len(names) > 1:
            for name, (kl, _, tokens) in zip(names, per_source.tolist(), strict=True):
                if tokens:
                    metrics[f"distill/reverse_kl/{name}"] = kl / tokens
        both = any(s.learn_from == "both" for s in self.config.task.named_sources.values())
        if both and self.config.distill.mode == "advantage":
            reward, teacher, sampled = totals[-3:].tolist()
            metrics["distill/advantage_reward"] = reward / max(sampled, 1.0)
            metrics["distill/advantage_teacher"] = teacher / max(sampled, 1.0)
        return metrics

    def update(self, step: int, batch: RolloutBatch) -> tuple[torch.Tensor, list[StepResult]]:
        """training.epochs passes of training.mini_batches optimizer steps over `batch`, each
        pass shuffled; returns the policy's logprobs [B, T] before the first step (the "old"
        policy of the PPO ratio) and every step's result."""
        training = self.config.training
        if optimizer_steps_per_step(training) == 1:
            # The old logprobs are the step's own forward: no extra pass.
            result = self.trainer.optimizer_step(batch, self.loss, step=step)
            self.routing = self.trainer.routing_counts()
            return result.logprobs_BT, [result]
        batch.old_logprobs_BT, _ = self.trainer.logprobs(
            batch.tokens_BT, routed_BTMK=batch.routed_experts_BTMK, images_B=batch.images_B
        )
        self.routing = self.trainer.routing_counts()  # of the old policy's pass alone
        # The same order on every rank of a TP group, which holds the same batch.
        shuffle = torch.Generator().manual_seed(self.config.job.seed * 1_000_003 + step)
        results = []
        for _ in range(training.epochs):
            order_B = torch.randperm(batch.batch_size, generator=shuffle)
            for rows in order_B.tensor_split(training.mini_batches):
                results.append(self.trainer.optimizer_step(batch.rows(rows), self.loss, step=step))
        self.trainer.drop_routing_counts()  # the updated policy's forwards: not compared
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
            mask_BT,
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
            "optimizer_steps": float(len(results)),
        }
        # The loss's own figures, each a share of the trained tokens (PolicyLoss.TOKEN_METRICS).
        for name, counted in self.loss.TOKEN_METRICS.items():
            if counted in results[0].metrics:
                summary[name] = total(counted) / tokens
        return summary

    def logprob_diff(
        self, step: int, batch: RolloutBatch, trainer_BT: torch.Tensor
    ) -> dict[str, float]:
        """How far the generator's logprobs of the sampled tokens are from the trainer's before
        the update, over all ranks (`offpolicy.behaviour_metrics`).

        Under batch-invariant mode any difference means the mode no longer holds: the run stops
        (or warns, `batch_invariant_on_mismatch`) naming the step and the first such token.
        """
        metrics, diff_BT = behaviour_metrics(batch, trainer_BT, self.loss.correction, self.group)
        if batch.versions_BT is not None:
            # Continuous placement: the promise holds for the tokens the trainer's weights
            # before the update sampled (version step - 1); older ones differ by design.
            diff_BT = diff_BT * (batch.versions_BT.to(diff_BT.device) == step - 1)
            largest = diff_BT.amax().cpu().reshape(1) if diff_BT.numel() else torch.zeros(1)
            platform.all_reduce_host(largest, op=dist.ReduceOp.MAX, group=self.group)
            metrics["logprob_diff/on_policy_max"] = float(largest[0])
        checked = metrics.get("logprob_diff/on_policy_max", metrics["logprob_diff/max"])
        if batch_invariant.is_enabled() and checked != 0.0:
            self.invariance_broken(step, batch, trainer_BT, diff_BT, checked)
        return metrics

    def routing_metrics(self) -> dict[str, float]:
        """MoE models: the share of (token, MoE layer) pairs whose top-k experts in the step's
        old-policy pass differ from the generator's, and how many pairs were compared (those
        the generator ran), over all ranks. Beside logprob_diff: where routing differs, so do
        the logprobs, by far more than kernel rounding."""
        if not self.trainer.is_mixture_of_experts:
            return {}
        counts = torch.tensor(self.routing, dtype=torch.float64)
        platform.all_reduce_host(counts, group=self.group)
        return {
            "moe/routing_mismatch": float(counts[0] / counts[1].clamp(min=1)),
            "moe/routing_compared": float(counts[1]),
        }

    def invariance_broken(self, step, batch, trainer_BT, diff_BT, largest: float) -> None:
        """Batch-invariant mode promised equal logprobs and a step saw a difference: every rank
        raises (or warns) together; ranks that hold a differing token name the first one."""
        differing = diff_BT.nonzero()
        if len(differing):
            b, t = (int(i) for i in differing[0])
            trainer, generator = trainer_BT[b, t], batch.generator_logprobs_BT[b, t]
            where = (
                f"first on rank {dist.get_rank()}, sequence {b}, token {t}: trainer "
                f"{float(trainer)!r}, generator {float(generator)!r}"
            )
        else:
            where = "on another rank"
        message = (
            f"step {step}: batch_invariant = true but trainer and generator logprobs differ "
            f"(logprob_diff/max = {largest:.3g}, {where}); see docs/batch_invariant.md "
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
            renderer = self.renderer_of(prompt)
            teacher = {}
            if batch.teacher_logprobs_BT is not None and batch.distilled_B[row]:
                # The teacher's logprob of each token of the sample (0 where not sampled).
                start = len(rollouts.completions.prompts[p])
                teacher_T = batch.teacher_logprobs_BT[row, start : start + len(sample.token_ids)]
                teacher = {
                    "prompt_token_ids": rollouts.completions.prompts[p],
                    "teacher_logprobs": teacher_T.tolist(),
                }
            samples.append(
                {
                    **({"source": prompt.source} if prompt.source else {}),
                    "prompt": renderer.text(prompt),
                    "completion": renderer.decode(sample.token_ids),
                    "messages": sample.messages,
                    "reward": float(rollouts.rewards_PN[p, 0]),
                    "token_ids": sample.token_ids,
                    "sampled_mask": sample.sampled_mask,
                    "generator_logprobs": sample.logprobs,
                    "logprob_diff": diffs.tolist(),
                    **teacher,
                }
            )
        self.metrics.log_rollouts(step, samples)


def rollout_metrics(
    config: JobConfig, rollouts: Rollouts, errors: int, group=None
) -> dict[str, float]:
    """Reward and length statistics over the samples of every rank of `group` (None: the
    world); `errors`: the reward errors so far (summed over the ranks too)."""
    rewards_PN, completions = rollouts.rewards_PN, rollouts.completions
    samples = [s for samples_N in completions.samples for s in samples_N]
    sums = torch.tensor(
        [
            float(rewards_PN.sum()),
            float((rewards_PN**2).sum()),
            float(rewards_PN.numel()),
            float(completions.num_tokens),
            float(zero_variance_P(rollouts.rewards_PN).sum()),
            float(rewards_PN.shape[0]),
            float(errors),
            float(rollouts.rounds),
            float(rollouts.parts),
            float(rollouts.generated),
            float(rollouts.short_groups),
            float(rollouts.truncated_PN().sum()),
            float(sum(s.turns for s in samples)),
            float(sum(s.tool_calls for s in samples)),
            float(sum(s.tool_errors for s in samples)),
            # Prompt and completion tokens of every sequence: what the trainer runs.
            float(
                sum(
                    len(prompt) * len(group) + sum(len(s.token_ids) for s in group)
                    for prompt, group in zip(completions.prompts, completions.samples, strict=True)
                )
            ),
        ],
        dtype=torch.float64,
    )
    # Each reward function's sum and count (NaN: a sample of a source without it), then each
    # source's reward sum, sample count and sampled tokens.
    names = sorted(rollouts.reward_parts_PN)
    sources = list(config.task.sources)
    by_name = [
        (float(v.nansum()), float((~v.isnan()).sum()))
        for _, v in sorted(rollouts.reward_parts_PN.items())
    ]
    lengths_PN = rollouts.lengths_PN()
    by_source = [source_sums(rollouts, lengths_PN, source) for source in sources]
    extra = [x for pair in by_name for x in pair] + [x for sums_ in by_source for x in sums_]
    base = len(sums)
    sums = torch.cat([sums, torch.tensor(extra, dtype=torch.float64)])
    platform.all_reduce_host(sums, group=group)
    part_sums = sums[base : base + 2 * len(names)].view(-1, 2).tolist()
    per_source = sums[base + 2 * len(names) :].view(-1, 3).tolist()
    sums = sums[:base]
    longest = torch.tensor([float(max((s.sampled_tokens for s in samples), default=0))])
    platform.all_reduce_host(longest, op=dist.ReduceOp.MAX, group=group)
    reward_sum, reward_sq, samples, tokens, flat_groups, groups, errors, *rest = sums.tolist()
    *rounds, truncated, turns, tool_calls, tool_errors, trained = rest
    mean = reward_sum / samples
    if config.algorithm.dynamic_sampling:
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
        "trained_tokens": trained,
        "env/turns": turns / samples,
        "env/tool_calls": tool_calls / samples,
        "env/tool_error_rate": tool_errors / max(tool_calls, 1.0),
        # An agent's tool errors are the calls the gateway could not parse (its tools' own
        # failures are the agent's business).
        **(
            {"agent/ill_formed_tool_calls": tool_errors / samples}
            if any(s.name == "agent" for s in config.task.named_sources.values())
            else {}
        ),
        # Each reward function's own mean (task.rewards), before its weight.
        **{
            f"reward/{name}": total / count
            for name, (total, count) in zip(names, part_sums, strict=True)
            if count
        },
        # Each source's (task.sources), over the steps it drew prompts in.
        **{
            key: value
            for source, (total, count, tokens) in zip(sources, per_source, strict=True)
            if count
            for key, value in (
                (f"reward/mean/{source}", total / count),
                (f"response_length/mean/{source}", tokens / count),
            )
        },
    }


def source_sums(
    rollouts: Rollouts, lengths_PN: torch.Tensor, source: str
) -> tuple[float, float, float]:
    """Reward sum, sample count and sampled tokens (of `lengths_PN`) of the groups of
    `source`."""
    keep_P = torch.tensor([p.source == source for p in rollouts.prompts], dtype=torch.bool)
    rewards_PN = rollouts.rewards_PN[keep_P]
    return float(rewards_PN.sum()), float(rewards_PN.numel()), float(lengths_PN[keep_P].sum())
