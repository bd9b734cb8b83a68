"""algorithm.advantage = "grpo": (r - group mean) / (group std + eps), with the sample std
(DeepSeekMath GRPO)."""

import torch


class GRPOAdvantage:
    """(r - group mean) / (group std + eps), the sample std (DeepSeekMath GRPO)."""

    def __init__(self, eps: float = 1e-6):
        self.eps = eps

    def __call__(self, rewards_PN: torch.Tensor) -> torch.Tensor:
        mean_P1 = rewards_PN.mean(dim=1, keepdim=True)
        std_P1 = rewards_PN.std(dim=1, keepdim=True)
        return (rewards_PN - mean_P1) / (std_P1 + self.eps)


ESTIMATOR = GRPOAdvantage
COMPARES_GROUP = True
