"""Advantage estimators over groups: the N samples of one prompt are compared with each other.

    .venv/bin/python -m pytest tests/unit/test_algorithms.py

Each estimator maps rewards [P, N] to advantages [P, N]. Shapes: P prompts, N samples per prompt.
"""

import torch


def zero_variance_P(rewards_PN: torch.Tensor) -> torch.Tensor:
    """True for each group whose rewards are all equal: no learning signal."""
    return (rewards_PN == rewards_PN[:, :1]).all(dim=1)


class GRPOAdvantage:
    """(r - group mean) / (group std + eps), the sample std (DeepSeekMath GRPO)."""

    def __init__(self, eps: float = 1e-6):
        self.eps = eps

    def __call__(self, rewards_PN: torch.Tensor) -> torch.Tensor:
        mean_P1 = rewards_PN.mean(dim=1, keepdim=True)
        std_P1 = rewards_PN.std(dim=1, keepdim=True)
        return (rewards_PN - mean_P1) / (std_P1 + self.eps)


class DrGRPOAdvantage:
    """r - group mean: no std normalization (Dr. GRPO, Liu et al. 2025)."""

    def __call__(self, rewards_PN: torch.Tensor) -> torch.Tensor:
        return rewards_PN - rewards_PN.mean(dim=1, keepdim=True)


class RLOOAdvantage:
    """r - mean of the other N - 1 rewards of the group (REINFORCE leave-one-out)."""

    def __call__(self, rewards_PN: torch.Tensor) -> torch.Tensor:
        n = rewards_PN.shape[1]
        others_mean = (rewards_PN.sum(dim=1, keepdim=True) - rewards_PN) / (n - 1)
        return rewards_PN - others_mean


ADVANTAGES = {"grpo": GRPOAdvantage, "dr_grpo": DrGRPOAdvantage, "rloo": RLOOAdvantage}


def build_advantage(name: str):
    """The estimator for `algorithm.advantage`."""
    return ADVANTAGES[name]()
