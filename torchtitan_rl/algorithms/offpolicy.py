"""Off-policy correction: the generator (behaviour) sampled with other weights or numerics
than the trainer's before the update (old).

    .venv/bin/python -m pytest tests/unit/test_algorithms.py tests/unit/test_trl_parity.py

Shapes: B sequences, T tokens, U units (T tokens, or 1 per sequence at sequence level).
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from torchtitan_rl import platform
from torchtitan_rl.types import RolloutBatch


@dataclass(frozen=True, slots=True)
class OffPolicyCorrection:
    """Importance weights old / behaviour of the sampled tokens (no gradient).

    tis: the ratio truncated to [ratio_min, ratio_max] (truncated IS; Yao et al. 2025);
    mis: the ratio where it lies in [ratio_min, ratio_max], else 0: the token (or sequence)
    leaves the loss (masked IS; IcePop). `level` sequence uses one ratio per sequence, the
    product over its tokens. mode none: weight 1. TRL's vllm_importance_sampling_mode
    token_truncate, token_mask, sequence_truncate and sequence_mask are these.
    """

    mode: str = "none"
    level: str = "token"
    ratio_min: float = 0.0
    ratio_max: float = 2.0

    def ratios(
        self, old_BT: torch.Tensor, behaviour_BT: torch.Tensor, mask_BT: torch.Tensor
    ) -> torch.Tensor:
        """The raw ratio old / behaviour [B, T], or [B, 1] at sequence level."""
        log_ratio_BT = ((old_BT - behaviour_BT) * mask_BT).detach()
        if self.level == "sequence":
            return torch.exp(log_ratio_BT.sum(dim=1, keepdim=True))
        return torch.exp(log_ratio_BT)

    def weights(self, ratio_BT: torch.Tensor) -> torch.Tensor:
        """What multiplies each token's policy loss, from `ratios`."""
        if self.mode == "tis":
            return ratio_BT.clamp(self.ratio_min, self.ratio_max)
        if self.mode == "mis":
            inside = (ratio_BT >= self.ratio_min) & (ratio_BT <= self.ratio_max)
            return ratio_BT * inside
        return torch.ones_like(ratio_BT)


def behaviour_metrics(
    batch: RolloutBatch,
    old_BT: torch.Tensor,
    correction: OffPolicyCorrection,
    group: dist.ProcessGroup | None = None,
) -> tuple[dict[str, float], torch.Tensor]:
    """The step's figures over every rank of `group`, and this rank's |old - behaviour| [B, T]:
    logprob_diff/max|mean, the ratio old / behaviour at the correction's level
    (offpolicy/ratio_mean|min|max), the largest weight the correction gave a unit
    (offpolicy/weight_max), the fraction of units the correction truncated or masked,
    and offpolicy/kl, the k3 estimate of KL(behaviour || old) per sampled token."""
    mask_BT = batch.loss_mask_BT.bool()
    log_ratio_BT = (old_BT - batch.generator_logprobs_BT) * mask_BT
    diff_BT = log_ratio_BT.abs()
    ratio_BU = correction.ratios(old_BT, batch.generator_logprobs_BT, mask_BT)
    units_BU = mask_BT if ratio_BU.shape[1] > 1 else mask_BT.any(dim=1, keepdim=True)
    weight_BU = correction.weights(ratio_BU)
    changed_BU = (weight_BU != ratio_BU) & units_BU
    k3_BT = (torch.exp(log_ratio_BT) - 1 - log_ratio_BT) * mask_BT
    sums = torch.stack(
        [
            diff_BT.sum(),
            mask_BT.sum(),
            (ratio_BU * units_BU).sum(),
            units_BU.sum(),
            changed_BU.sum(),
            k3_BT.sum(),
        ]
    )
    # Max of (max, -min): one MAX reduction.
    extremes = torch.stack(
        [
            diff_BT.max(),
            ratio_BU.masked_fill(~units_BU, 1.0).max(),
            -ratio_BU.masked_fill(~units_BU, 1.0).min(),
            weight_BU.masked_fill(~units_BU, 0.0).max(),
        ]
    )
    sums, extremes = sums.double().cpu(), extremes.cpu()
    platform.all_reduce_host(sums, group=group)
    platform.all_reduce_host(extremes, op=dist.ReduceOp.MAX, group=group)
    diff_sum, tokens, ratio_sum, units, changed, k3_sum = sums.tolist()
    metrics = {
        "logprob_diff/max": float(extremes[0]),
        "logprob_diff/mean": diff_sum / max(tokens, 1),
        "offpolicy/ratio_mean": ratio_sum / max(units, 1),
        "offpolicy/ratio_max": float(extremes[1]),
        "offpolicy/ratio_min": -float(extremes[2]),
        "offpolicy/weight_max": float(extremes[3]),
        "offpolicy/kl": k3_sum / max(tokens, 1),
    }
    if correction.mode == "tis":
        metrics["offpolicy/truncated_fraction"] = changed / max(units, 1)
    if correction.mode == "mis":
        metrics["offpolicy/masked_fraction"] = changed / max(units, 1)
    return metrics, diff_BT
