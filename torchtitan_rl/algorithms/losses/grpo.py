"""algorithm.loss = "grpo": PPO's clipped ratio per token, clip 0.2/0.2, each sequence's
token mean averaged over sequences (DeepSeekMath GRPO; TRL's "grpo" loss type)."""

from torchtitan_rl.algorithms.losses import PolicyLoss, policy_loss

# What it sets of the [algorithm] fields left unset (AlgorithmSection.resolve).
PRESET = {
    "clip_eps_low": 0.2,
    "clip_eps_high": 0.2,
    "aggregation": "seq_mean_token_mean",
    "dynamic_sampling": False,
}


def build(algorithm, max_tokens: int, teacher_coef: float = 0.0) -> PolicyLoss:
    return policy_loss(algorithm, max_tokens, level="token", teacher_coef=teacher_coef)
