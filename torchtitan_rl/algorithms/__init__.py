"""RL algorithms: advantage estimators and policy losses, each a small class chosen by config."""

from torchtitan_rl.algorithms.advantages import build_advantage
from torchtitan_rl.algorithms.losses import build_loss

__all__ = ["build_advantage", "build_loss"]
