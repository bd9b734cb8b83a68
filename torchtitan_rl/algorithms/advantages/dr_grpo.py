"""algorithm.advantage = "dr_grpo": r - group mean, no std normalization (Dr. GRPO, Liu et
al. 2025)."""

import torch


class DrGRPOAdvantage:
    """r - group mean: no std normalization (Dr. GRPO, Liu et al. 2025)."""

    def __call__(self, rewards_PN: torch.Tensor) -> torch.Tensor:
        return rewards_PN - rewards_PN.mean(dim=1, keepdim=True)


ESTIMATOR = DrGRPOAdvantage
COMPARES_GROUP = True
