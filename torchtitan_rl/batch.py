"""Typed batches passed between generation, scoring and training.

    .venv/bin/python -m pytest tests/unit/test_logprobs.py

Shapes: B sequences, T tokens (prompt + completion, right-padded).
"""

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torchtitan_rl.generator.engine import Sample


@dataclass(frozen=True, slots=True)
class LossScale:
    """Global totals of one step, over every micro-batch and data-parallel rank."""

    tokens: int
    """Loss-masked tokens in the whole step."""
    sequences: int
    """Sequences in the whole step."""


@dataclass(kw_only=True, slots=True)
class RolloutBatch:
    """One rank's training batch: right-padded sequences and what the loss needs of them.
    An SFT batch holds only tokens and the loss mask (its assistant tokens)."""

    tokens_BT: torch.Tensor
    """Prompt + completion token ids, right-padded, int64."""
    loss_mask_BT: torch.Tensor
    """1.0 where the token is a sampled completion token whose logprob is trained, else 0.0."""
    advantages_B: torch.Tensor | None = None
    """Advantage of each sequence (None in an SFT batch, which trains on demonstrations)."""
    generator_logprobs_BT: torch.Tensor | None = None
    """Logprob the generator reported for each sampled token (0 where loss_mask is 0; None in
    an SFT batch)."""
    reference_logprobs_BT: torch.Tensor | None = None
    """Logprob of each token under the frozen reference model (only with a KL penalty)."""
    old_logprobs_BT: torch.Tensor | None = None
    """Logprob of each token under the policy before the batch's first update (only with
    several updates per batch; else the loss takes its own forward's, detached)."""

    @property
    def batch_size(self) -> int:
        return self.tokens_BT.shape[0]

    def split(self, n: int) -> list["RolloutBatch"]:
        """`n` micro-batches of consecutive rows (the last ones may be one row shorter)."""
        if not 1 <= n <= self.batch_size:
            raise ValueError(f"cannot split {self.batch_size} sequences into {n} micro-batches")
        parts = {
            f.name: torch.tensor_split(getattr(self, f.name), n)
            for f in fields(self)
            if getattr(self, f.name) is not None
        }
        return [RolloutBatch(**{k: v[i] for k, v in parts.items()}) for i in range(n)]

    @staticmethod
    def cat(batches: list["RolloutBatch"]) -> "RolloutBatch":
        """The rows of `batches` in order, right-padded with 0 to the widest (the fields the
        first batch holds)."""
        width = max(b.tokens_BT.shape[1] for b in batches)
        names = [f.name for f in fields(RolloutBatch) if getattr(batches[0], f.name) is not None]

        def widened(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.dim() < 2:
                return tensor
            return torch.nn.functional.pad(tensor, (0, width - tensor.shape[1]))

        return RolloutBatch(
            **{name: torch.cat([widened(getattr(b, name)) for b in batches]) for name in names}
        )

    def rows(self, index_R: torch.Tensor) -> "RolloutBatch":
        """The batch of the rows `index_R`, in that order."""
        return self._map(lambda tensor: tensor[index_R.to(tensor.device)])

    def to(self, device: torch.device) -> "RolloutBatch":
        return self._map(lambda tensor: tensor.to(device))

    def _map(self, fn) -> "RolloutBatch":
        """`fn` applied to every tensor the batch holds."""
        return RolloutBatch(
            **{
                f.name: fn(getattr(self, f.name))
                for f in fields(self)
                if getattr(self, f.name) is not None
            }
        )


def rollout_batch(
    prompts: list[list[int]],
    samples: "list[list[Sample]]",
    advantages_PN: torch.Tensor,
    pad_id: int,
) -> RolloutBatch:
    """Right-padded RolloutBatch of every (prompt, sample) pair, prompt-major.

    `samples[p][n]` is the n-th sample of prompt p (an episode: its turns and the environment's
    replies between them); the loss mask covers exactly the sampled tokens (a sampled stop
    token included, an environment's tokens not), with the generator's logprobs there.
    """
    rows, masks, logprobs, advantages = [], [], [], []
    for p, prompt in enumerate(prompts):
        for n, sample in enumerate(samples[p]):
            sampled = sample.sampled_mask or [1] * len(sample.token_ids)
            rows.append(prompt + sample.token_ids)
            masks.append([0.0] * len(prompt) + [float(m) for m in sampled])
            logprobs.append([0.0] * len(prompt) + list(sample.logprobs))
            advantages.append(float(advantages_PN[p, n]))
    width = max(len(r) for r in rows)

    def pad(values: list, fill) -> list:
        return values + [fill] * (width - len(values))

    return RolloutBatch(
        tokens_BT=torch.tensor([pad(r, pad_id) for r in rows], dtype=torch.long),
        loss_mask_BT=torch.tensor([pad(m, 0.0) for m in masks]),
        advantages_B=torch.tensor(advantages),
        generator_logprobs_BT=torch.tensor([pad(lp, 0.0) for lp in logprobs]),
    )
