"""Policy losses: one small class, called by PolicyTrainer.optimizer_step per micro-batch;
each algorithm.loss is a module here (grpo, dapo, gspo: registry.py) that builds one.

    .venv/bin/python -m pytest tests/unit/test_algorithms.py tests/unit/test_trl_parity.py

Three logprobs of each sampled token meet here:
  current    the policy being updated, with gradient;
  old        the policy before the rollout batch's first update (`batch.old_logprobs_BT`; with
             one update per batch, the step's own forward, detached: the same numbers);
  behaviour  the generator's, that sampled the token (`batch.generator_logprobs_BT`): older
             weights when off-policy, other numerics when not batch-invariant.
The PPO ratio current / old is clipped (per token, or per sequence for GSPO); the off-policy
correction old / behaviour truncates (TIS) or masks (MIS) each token's loss; the KL to the
frozen reference joins per token, and with a distill teacher in mode loss, the KL to the
teacher. Each micro-batch's share is normalized by the global counts
of its optimizer step (LossScale), so micro-batching and data parallelism give the full-batch
gradient. Shapes: B sequences, T tokens.
"""

import torch

from torchtitan_rl.algorithms import registry
from torchtitan_rl.algorithms.offpolicy import OffPolicyCorrection
from torchtitan_rl.types import LossScale, RolloutBatch

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant")


def aggregate(
    per_token_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    scale: LossScale,
    mode: str,
    max_tokens: int,
) -> torch.Tensor:
    """This micro-batch's share of the step loss under aggregation `mode` (veRL's names).

    token_mean: sum over every sampled token / the step's tokens (DAPO; TRL "dapo");
    seq_mean_token_mean: each sequence's token mean, averaged over the step's sequences (the
    GRPO paper; TRL "grpo"); seq_mean_token_sum: each sequence's token sum, averaged over the
    sequences (TRL "luspo"); constant: sum / (the step's sequences * max_tokens) (Dr. GRPO: no
    length bias; TRL "dr_grpo").
    """
    masked_BT = per_token_BT * mask_BT
    if mode == "token_mean":
        return masked_BT.sum() / max(scale.tokens, 1)
    if mode == "seq_mean_token_mean":
        lengths_B = mask_BT.sum(dim=1).clamp(min=1)
        return (masked_BT.sum(dim=1) / lengths_B).sum() / max(scale.sequences, 1)
    if mode == "seq_mean_token_sum":
        return masked_BT.sum() / max(scale.sequences, 1)
    if mode == "constant":
        return masked_BT.sum() / (max(scale.sequences, 1) * max_tokens)
    raise ValueError(f"unknown aggregation {mode!r}: use one of {', '.join(AGGREGATIONS)}")


def kl_penalty(
    logprobs_BT: torch.Tensor,
    reference_BT: torch.Tensor,
    estimator: str,
    mask_BT: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from the sampled tokens (Schulman's k1, k2,
    k3, with r = reference - policy logprob): k1 = -r, k2 = r^2 / 2, k3 = exp(r) - 1 - r.

    `mask_BT`: where the reference holds logprobs (it is scored only at sampled tokens); it is
    0 elsewhere, where exp(r) of a very unlikely token would overflow to inf, and inf times the
    loss mask's 0 is NaN, in the loss and its gradient. There r is 0 (as is the estimate)."""
    if mask_BT is not None:
        reference_BT = torch.where(mask_BT.bool(), reference_BT, logprobs_BT.detach())
    r_BT = reference_BT - logprobs_BT
    if estimator == "k1":
        return -r_BT
    if estimator == "k2":
        return r_BT**2 / 2
    return torch.exp(r_BT) - 1 - r_BT


class PolicyLoss:
    """PPO's clipped surrogate, with the ratio per token (grpo, dapo) or per sequence (gspo).

    Per token: -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A); with
    `clip_ratio_c` > 1 (dual clip, Ye et al. 2020) a negative-advantage token's loss is also
    capped at -clip_ratio_c * A. GSPO (Zheng et al. 2025) uses one ratio per sequence,
    exp(mean over its sampled tokens of current - old), for every token of it. The off-policy
    weight multiplies the clipped term; the KL term adds k(current, reference) * kl_beta, and
    `teacher_coef` * k(current, teacher) on the rows of distilled sources. A batch's per-token
    advantages (`token_advantages_BT`, a teacher's) add to its sequences'.

    Its metrics are device tensors (0-dim sums), which the policy trainer reads once per
    step, not once per micro-batch. TOKEN_METRICS: each figure the loss reports, as a share of
    the step's trained tokens (the logged name -> the count or sum its micro-batches return);
    logged where returned.
    """

    TOKEN_METRICS = {
        "clip_fraction": "clipped_tokens",
        "dual_clip_fraction": "dual_clipped_tokens",
        "kl": "kl_sum",
        "distill/kl": "teacher_kl_sum",
    }

    def __init__(
        self,
        *,
        level: str = "token",
        clip_low: float,
        clip_high: float,
        clip_ratio_c: float = 0.0,
        aggregation: str,
        max_tokens: int,
        correction: OffPolicyCorrection | None = None,
        kl_beta: float = 0.0,
        kl_estimator: str = "k3",
        teacher_coef: float = 0.0,
    ):
        self.level = level
        self.clip_low, self.clip_high, self.clip_ratio_c = clip_low, clip_high, clip_ratio_c
        self.aggregation, self.max_tokens = aggregation, max_tokens
        self.correction = correction or OffPolicyCorrection()
        self.kl_beta, self.kl_estimator = kl_beta, kl_estimator
        self.teacher_coef = teacher_coef

    def __call__(self, logprobs_BT: torch.Tensor, batch: RolloutBatch, scale: LossScale):
        mask_BT = batch.loss_mask_BT
        old_BT = batch.old_logprobs_BT if batch.old_logprobs_BT is not None else logprobs_BT
        log_ratio_BT = logprobs_BT - old_BT.detach()
        if self.level == "sequence":
            lengths_B1 = mask_BT.sum(dim=1, keepdim=True).clamp(min=1)
            log_ratio_BT = (log_ratio_BT * mask_BT).sum(dim=1, keepdim=True) / lengths_B1
        ratio_BT = torch.exp(log_ratio_BT)  # [B, T], or [B, 1] at sequence level
        advantages_B1 = batch.advantages_B[:, None]  # [B, 1], or [B, T] with token advantages
        if batch.token_advantages_BT is not None:
            advantages_B1 = advantages_B1 + batch.token_advantages_BT
        unclipped_BT = -ratio_BT * advantages_B1
        clipped_BT = -ratio_BT.clamp(1 - self.clip_low, 1 + self.clip_high) * advantages_B1
        per_token_BT = torch.maximum(unclipped_BT, clipped_BT)
        clipped_mask_BT = (clipped_BT > unclipped_BT).expand_as(mask_BT) * mask_BT
        metrics = {"clipped_tokens": clipped_mask_BT.sum()}
        if self.clip_ratio_c > 0:
            cap_B1 = -self.clip_ratio_c * advantages_B1
            dual_BT = (advantages_B1 < 0) & (per_token_BT > cap_B1)
            per_token_BT = torch.where(dual_BT, cap_B1, per_token_BT)
            metrics["dual_clipped_tokens"] = (dual_BT.expand_as(mask_BT) * mask_BT).sum()
        if self.correction.mode != "none":
            ratios = self.correction.ratios(old_BT, batch.generator_logprobs_BT, mask_BT)
            per_token_BT = per_token_BT * self.correction.weights(ratios)
        per_token_BT = per_token_BT.expand_as(mask_BT)
        if self.kl_beta > 0:
            kl_BT = kl_penalty(logprobs_BT, batch.reference_logprobs_BT, self.kl_estimator, mask_BT)
            per_token_BT = per_token_BT + self.kl_beta * kl_BT
            metrics["kl_sum"] = (kl_BT.detach() * mask_BT).sum()
        if self.teacher_coef > 0:
            kl_BT = kl_penalty(logprobs_BT, batch.teacher_logprobs_BT, self.kl_estimator, mask_BT)
            kl_BT = kl_BT * batch.distilled_B[:, None]
            per_token_BT = per_token_BT + self.teacher_coef * kl_BT
            metrics["teacher_kl_sum"] = (kl_BT.detach() * mask_BT).sum()
        loss = aggregate(per_token_BT, mask_BT, scale, self.aggregation, self.max_tokens)
        return loss, metrics


def build_loss(algorithm, max_tokens: int, distill=None):
    """The loss of the (validated) `algorithm` config section: its algorithm.loss module's
    (registry.py), with the teacher's KL term when the `distill` section's teacher is in mode
    loss."""
    teaches = distill is not None and distill.enabled and distill.mode == "loss"
    module = registry.load("loss", algorithm.loss)
    return module.build(algorithm, max_tokens, teacher_coef=distill.coef if teaches else 0.0)


def policy_loss(algorithm, max_tokens: int, level: str, teacher_coef: float) -> PolicyLoss:
    """PPO's clipped surrogate with the ratio per `level` (token or sequence), clipped and
    aggregated as the (resolved) `algorithm` section says."""
    return PolicyLoss(
        level=level,
        clip_low=algorithm.clip_eps_low,
        clip_high=algorithm.clip_eps_high,
        clip_ratio_c=algorithm.clip_ratio_c,
        aggregation=algorithm.aggregation,
        max_tokens=max_tokens,
        correction=build_correction(algorithm),
        kl_beta=0.0 if algorithm.kl_in_reward else algorithm.kl_beta,
        kl_estimator=algorithm.kl_estimator,
        teacher_coef=teacher_coef,
    )


def build_correction(algorithm) -> OffPolicyCorrection:
    """The off-policy correction of the (validated) `algorithm` config section."""
    if algorithm.offpolicy_correction == "none":
        return OffPolicyCorrection()
    return OffPolicyCorrection(
        mode=algorithm.offpolicy_correction,
        level=algorithm.offpolicy_level,
        ratio_min=algorithm.offpolicy_ratio_min,
        ratio_max=algorithm.offpolicy_ratio_max,
    )
