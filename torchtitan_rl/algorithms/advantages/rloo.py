"""algorithm.advantage = "rloo": r - the mean of the other N - 1 rewards of the group
(REINFORCE leave-one-out)."""

import torch


class RLOOAdvantage:
    """r - mean of the other N - 1 rewards of the group (REINFORCE leave-one-out)."""

    def __call__(self, rewards_PN: torch.Tensor) -> torch.Tensor:
        n = rewards_PN.shape[1]
        others_mean = (rewards_PN.sum(dim=1, keepdim=True) - rewards_PN) / (n - 1)
        return rewards_PN - others_mean


ESTIMATOR = RLOOAdvantage
COMPARES_GROUP = True
