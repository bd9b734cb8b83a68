"""Policy losses: one small class per variant, called by PolicyTrainer.train_step per micro-batch.

    .venv/bin/python -m pytest tests/test_algorithms.py

Each loss returns this micro-batch's share of the step loss, normalized by the step's global
counts (LossScale), so micro-batching and data parallelism give the full-batch gradient.
The "old" policy is the trainer's own logprobs at the step's forward (detached): one update
per batch, so the PPO ratio starts at 1. Truncated importance sampling (TIS) corrects for the
generator sampling with slightly different numerics: weight min(p_trainer / p_generator, cap).
Shapes: B sequences, T tokens.
"""

import torch

from torchtitan_rl.batch import RolloutBatch
from torchtitan_rl.trainer.policy_trainer import LossScale


def aggregate(
    per_token_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    scale: LossScale,
    mode: str,
    max_tokens: int,
) -> torch.Tensor:
    """This micro-batch's share of the step loss under aggregation `mode`.

    token_mean: sum over every sampled token / the step's tokens (DAPO);
    sequence_mean: each sequence's token mean, summed / the step's sequences (GRPO paper);
    constant: sum / (the step's sequences * max_tokens) (Dr. GRPO: no length bias).
    """
    masked_BT = per_token_BT * mask_BT
    if mode == "token_mean":
        return masked_BT.sum() / max(scale.tokens, 1)
    if mode == "sequence_mean":
        lengths_B = mask_BT.sum(dim=1).clamp(min=1)
        return (masked_BT.sum(dim=1) / lengths_B).sum() / scale.sequences
    if mode == "constant":
        return masked_BT.sum() / (scale.sequences * max_tokens)
    raise ValueError(f"unknown aggregation {mode!r}")


def kl_penalty(
    logprobs_BT: torch.Tensor, reference_BT: torch.Tensor, estimator: str
) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from the sampled tokens (Schulman's k1, k2,
    k3, with r = reference - policy logprob): k1 = -r, k2 = r^2 / 2, k3 = exp(r) - 1 - r."""
    r_BT = reference_BT - logprobs_BT
    if estimator == "k1":
        return -r_BT
    if estimator == "k2":
        return r_BT**2 / 2
    return torch.exp(r_BT) - 1 - r_BT


def tis_weight(old_BT: torch.Tensor, generator_BT: torch.Tensor, cap: float) -> torch.Tensor:
    """min(exp(old - generator), cap): truncated importance weight (no gradient)."""
    return torch.exp(old_BT - generator_BT).clamp(max=cap)


class PPOClipLoss:
    """Token-level PPO clipped surrogate: GRPO (symmetric clip) and DAPO (clip-higher)."""

    def __init__(
        self,
        *,
        clip_low: float,
        clip_high: float,
        aggregation: str,
        max_tokens: int,
        tis_cap: float = 0.0,
        kl_beta: float = 0.0,
        kl_estimator: str = "k3",
    ):
        self.clip_low, self.clip_high = clip_low, clip_high
        self.aggregation, self.max_tokens, self.tis_cap = aggregation, max_tokens, tis_cap
        self.kl_beta, self.kl_estimator = kl_beta, kl_estimator

    def __call__(self, logprobs_BT: torch.Tensor, batch: RolloutBatch, scale: LossScale):
        mask_BT = batch.loss_mask_BT
        old_BT = logprobs_BT.detach()
        ratio_BT = torch.exp(logprobs_BT - old_BT)
        advantages_B1 = batch.advantages_B[:, None]
        unclipped_BT = ratio_BT * advantages_B1
        clipped_BT = ratio_BT.clamp(1 - self.clip_low, 1 + self.clip_high) * advantages_B1
        per_token_BT = -torch.minimum(unclipped_BT, clipped_BT)
        if self.tis_cap > 0:
            per_token_BT = per_token_BT * tis_weight(
                old_BT, batch.generator_logprobs_BT, self.tis_cap
            )
        metrics = {"clipped_tokens": float(((clipped_BT != unclipped_BT).float() * mask_BT).sum())}
        if self.kl_beta > 0:
            kl_BT = kl_penalty(logprobs_BT, batch.reference_logprobs_BT, self.kl_estimator)
            per_token_BT = per_token_BT + self.kl_beta * kl_BT
            metrics["kl_sum"] = float((kl_BT.detach() * mask_BT).sum())
        loss = aggregate(per_token_BT, mask_BT, scale, self.aggregation, self.max_tokens)
        return loss, metrics


class GSPOLoss:
    """Sequence-level ratio (GSPO, Zheng et al. 2025): s = exp(mean over the sequence's sampled
    tokens of (logprob - old)), clipped per sequence, averaged over the step's sequences."""

    def __init__(
        self,
        *,
        clip_low: float,
        clip_high: float,
        tis_cap: float = 0.0,
        kl_beta: float = 0.0,
        kl_estimator: str = "k3",
        **_,
    ):
        self.clip_low, self.clip_high, self.tis_cap = clip_low, clip_high, tis_cap
        self.kl_beta, self.kl_estimator = kl_beta, kl_estimator

    def __call__(self, logprobs_BT: torch.Tensor, batch: RolloutBatch, scale: LossScale):
        mask_BT = batch.loss_mask_BT
        old_BT = logprobs_BT.detach()
        lengths_B = mask_BT.sum(dim=1).clamp(min=1)
        ratio_B = torch.exp(((logprobs_BT - old_BT) * mask_BT).sum(dim=1) / lengths_B)
        advantages_B = batch.advantages_B
        unclipped_B = ratio_B * advantages_B
        clipped_B = ratio_B.clamp(1 - self.clip_low, 1 + self.clip_high) * advantages_B
        per_sequence_B = -torch.minimum(unclipped_B, clipped_B)
        if self.tis_cap > 0:
            log_ratio_B = ((old_BT - batch.generator_logprobs_BT) * mask_BT).sum(1) / lengths_B
            per_sequence_B = per_sequence_B * torch.exp(log_ratio_B).clamp(max=self.tis_cap)
        loss = per_sequence_B.sum() / scale.sequences
        metrics = {"clipped_tokens": float((mask_BT.sum(dim=1) * (clipped_B != unclipped_B)).sum())}
        if self.kl_beta > 0:
            # The KL term stays per token: token-mean over the step, added to the sequence loss.
            kl_BT = kl_penalty(logprobs_BT, batch.reference_logprobs_BT, self.kl_estimator)
            loss = loss + self.kl_beta * (kl_BT * mask_BT).sum() / max(scale.tokens, 1)
            metrics["kl_sum"] = float((kl_BT.detach() * mask_BT).sum())
        return loss, metrics


LOSSES = {"grpo": PPOClipLoss, "dapo": PPOClipLoss, "gspo": GSPOLoss}


def build_loss(algorithm, max_tokens: int):
    """The loss for the `algorithm` config section."""
    return LOSSES[algorithm.loss](
        clip_low=algorithm.clip_eps_low,
        clip_high=algorithm.clip_eps_high,
        aggregation=algorithm.aggregation,
        max_tokens=max_tokens,
        tis_cap=algorithm.tis_cap,
        kl_beta=algorithm.kl_beta,
        kl_estimator=algorithm.kl_estimator,
    )
