"""Advantage estimators over groups: the N samples of one prompt are compared with each other.

    .venv/bin/python -m pytest tests/test_algorithms.py

Shapes: P prompts, N samples per prompt.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class GroupAdvantages:
    values_PN: torch.Tensor
    """Advantage of each sample."""
    zero_variance_PN: torch.Tensor
    """True for every sample of a group whose rewards are all equal (no learning signal)."""


def zero_variance_P(rewards_PN: torch.Tensor) -> torch.Tensor:
    """True for each group whose rewards are all equal: no learning signal."""
    return (rewards_PN == rewards_PN[:, :1]).all(dim=1)


def _zero_variance(rewards_PN: torch.Tensor) -> torch.Tensor:
    return zero_variance_P(rewards_PN)[:, None].expand_as(rewards_PN)


class GRPOAdvantage:
    """(r - group mean) / (group std + eps), the sample std (DeepSeekMath GRPO)."""

    def __init__(self, eps: float = 1e-6):
        self.eps = eps

    def __call__(self, rewards_PN: torch.Tensor) -> GroupAdvantages:
        mean_P1 = rewards_PN.mean(dim=1, keepdim=True)
        std_P1 = rewards_PN.std(dim=1, keepdim=True)
        values = (rewards_PN - mean_P1) / (std_P1 + self.eps)
        return GroupAdvantages(values, _zero_variance(rewards_PN))


class DrGRPOAdvantage:
    """r - group mean: no std normalization (Dr. GRPO, Liu et al. 2025)."""

    def __call__(self, rewards_PN: torch.Tensor) -> GroupAdvantages:
        values = rewards_PN - rewards_PN.mean(dim=1, keepdim=True)
        return GroupAdvantages(values, _zero_variance(rewards_PN))


class RLOOAdvantage:
    """r - mean of the other N - 1 rewards of the group (REINFORCE leave-one-out)."""

    def __call__(self, rewards_PN: torch.Tensor) -> GroupAdvantages:
        n = rewards_PN.shape[1]
        others_mean = (rewards_PN.sum(dim=1, keepdim=True) - rewards_PN) / (n - 1)
        return GroupAdvantages(rewards_PN - others_mean, _zero_variance(rewards_PN))


ADVANTAGES = {"grpo": GRPOAdvantage, "dr_grpo": DrGRPOAdvantage, "rloo": RLOOAdvantage}


def build_advantage(name: str):
    """The estimator for `algorithm.advantage`."""
    return ADVANTAGES[name]()
