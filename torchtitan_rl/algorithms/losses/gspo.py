"""algorithm.loss = "gspo": one ratio per sequence (the exp of its tokens' mean log-ratio),
clip 3e-4/4e-4, seq_mean_token_mean (GSPO, Zheng et al. 2025)."""

from torchtitan_rl.algorithms.losses import PolicyLoss, policy_loss

# What it sets of the [algorithm] fields left unset (AlgorithmSection.resolve).
PRESET = {
    "clip_eps_low": 3e-4,
    "clip_eps_high": 4e-4,
    "aggregation": "seq_mean_token_mean",
    "dynamic_sampling": False,
}


def build(algorithm, max_tokens: int, teacher_coef: float = 0.0) -> PolicyLoss:
    return policy_loss(algorithm, max_tokens, level="sequence", teacher_coef=teacher_coef)
