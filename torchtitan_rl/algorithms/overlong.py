"""What happens to completions cut by max_tokens (algorithm.overlong).

.venv/bin/python -m pytest tests/unit/test_algorithms.py -k overlong

Shapes: P prompts, N samples per prompt.
"""

import torch


def soft_penalty_PN(lengths_PN: torch.Tensor, max_tokens: int, buffer: int) -> torch.Tensor:
    """DAPO's overlong reward shaping (eq. 13): 0 up to max_tokens - buffer tokens, then down
    linearly to -1 at max_tokens."""
    start = max_tokens - buffer
    return -((lengths_PN.float() - start).clamp(min=0) / buffer).clamp(max=1.0)


def overlong_rewards(
    rewards_PN: torch.Tensor,
    lengths_PN: torch.Tensor,
    truncated_PN: torch.Tensor,
    mode: str,
    max_tokens: int,
    buffer: int | None,
) -> torch.Tensor:
    """The rewards the advantages see: zero_reward gives truncated samples 0, soft_penalty adds
    DAPO's length penalty to every sample; keep and mask leave them (mask acts on the loss)."""
    if mode == "zero_reward":
        return rewards_PN.masked_fill(truncated_PN, 0.0)
    if mode == "soft_penalty":
        return rewards_PN + soft_penalty_PN(lengths_PN, max_tokens, buffer)
    return rewards_PN


def overlong_keep_PN(truncated_PN: torch.Tensor, mode: str) -> torch.Tensor:
    """Samples whose tokens stay in the loss: all but the truncated ones with mode = mask."""
    return ~truncated_PN if mode == "mask" else torch.ones_like(truncated_PN)
