"""algorithm.loss = "dapo": the same ratio per token with clip-higher 0.2/0.28, the token
mean over the step, and dynamic sampling (DAPO, Yu et al. 2025)."""

from torchtitan_rl.algorithms.losses import PolicyLoss, policy_loss

# What it sets of the [algorithm] fields left unset (AlgorithmSection.resolve).
PRESET = {
    "clip_eps_low": 0.2,
    "clip_eps_high": 0.28,
    "aggregation": "token_mean",
    "dynamic_sampling": True,
}


def build(algorithm, max_tokens: int, teacher_coef: float = 0.0) -> PolicyLoss:
    return policy_loss(algorithm, max_tokens, level="token", teacher_coef=teacher_coef)
