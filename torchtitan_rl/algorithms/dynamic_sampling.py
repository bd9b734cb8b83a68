"""Dynamic sampling (DAPO): keep the groups with learning signal over several generation rounds.

.venv/bin/python -m pytest tests/unit/test_algorithms.py -k informative
"""

import torch

from torchtitan_rl.algorithms.advantages import zero_variance_P
from torchtitan_rl.types import Rollouts


def fill_informative(rounds: list[Rollouts], wanted: int) -> Rollouts:
    """Dynamic sampling: the first `wanted` groups with learning signal over `rounds`, topped
    up with groups without (short_groups counts them) when there are not enough."""
    generated = Rollouts.cat(rounds)
    informative_P = ~zero_variance_P(generated.rewards_PN)
    rank_P = torch.arange(len(generated))
    # Informative groups first, in generation order, then the others.
    order = torch.cat([rank_P[informative_P], rank_P[~informative_P]])[:wanted]
    keep_P = torch.zeros(len(generated), dtype=torch.bool)
    keep_P[order] = True
    kept = generated.groups(keep_P)
    kept.rounds = len(rounds)
    kept.generated_groups = len(generated)
    kept.short_groups = max(0, wanted - int(informative_P.sum()))
    kept.env_s = generated.env_s
    return kept
