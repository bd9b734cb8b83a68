"""Typed batches passed between generation, scoring and training.

    .venv/bin/python -m pytest tests/test_logprobs.py

Shapes: B sequences, T tokens (prompt + completion, right-padded).
"""

from dataclasses import dataclass, fields

import torch


@dataclass(kw_only=True, slots=True)
class RolloutBatch:
    """One rank's training batch: right-padded sequences and what the loss needs of them."""

    tokens_BT: torch.Tensor
    """Prompt + completion token ids, right-padded, int64."""
    loss_mask_BT: torch.Tensor
    """1.0 where the token is a sampled completion token whose logprob is trained, else 0.0."""
    advantages_B: torch.Tensor
    """Advantage of each sequence."""
    generator_logprobs_BT: torch.Tensor
    """Logprob the generator reported for each sampled token (0 where loss_mask is 0)."""

    @property
    def batch_size(self) -> int:
        return self.tokens_BT.shape[0]

    def split(self, n: int) -> list["RolloutBatch"]:
        """`n` micro-batches of consecutive rows (the last ones may be one row shorter)."""
        if not 1 <= n <= self.batch_size:
            raise ValueError(f"cannot split {self.batch_size} sequences into {n} micro-batches")
        parts = {f.name: torch.tensor_split(getattr(self, f.name), n) for f in fields(self)}
        return [RolloutBatch(**{k: v[i] for k, v in parts.items()}) for i in range(n)]

    def to(self, device: torch.device) -> "RolloutBatch":
        return RolloutBatch(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})
