"""Advantage estimators over groups: the N samples of one prompt are compared with each other.

    .venv/bin/python -m pytest tests/unit/test_algorithms.py

Each estimator (one module here, registry.py) maps rewards [P, N] to advantages [P, N].
Shapes: P prompts, N samples per prompt.
"""

import torch

from torchtitan_rl.algorithms import registry


def zero_variance_P(rewards_PN: torch.Tensor) -> torch.Tensor:
    """True for each group whose rewards are all equal: no learning signal."""
    return (rewards_PN == rewards_PN[:, :1]).all(dim=1)


def build_advantage(name: str):
    """The estimator for `algorithm.advantage`."""
    return registry.load("advantage", name).ESTIMATOR()
