"""Rollouts: one rank's scored samples of a step, as they travel from generation to training.

    .venv/bin/python -m pytest tests/unit/test_algorithms.py

Shapes: P prompts, N samples per prompt.
"""

from dataclasses import dataclass

import torch

from torchtitan_rl.algorithms.advantages import zero_variance_P
from torchtitan_rl.generator.engine import Completions
from torchtitan_rl.tasks import Prompt


@dataclass(slots=True)
class Rollouts:
    """Prompts, their N samples each and the task's rewards; groups in prompt order."""

    prompts: list[Prompt]
    completions: Completions
    rewards_PN: torch.Tensor
    """The task's reward of each sample (before any KL penalty)."""
    rounds: int = 1
    """Generation rounds it took (dynamic sampling), summed over its parts by `cat`."""
    parts: int = 1
    """How many ranks' rollouts `cat` joined into this one."""
    generated_groups: int = 0
    """Groups generated over every round, kept or not (summed by `cat`); 0: len(prompts)."""
    short_groups: int = 0
    """Groups without learning signal kept because the rounds ran out (dynamic sampling)."""
    env_s: float = 0.0
    """Seconds spent in the environments (rewards included; summed by `cat`)."""

    def __len__(self) -> int:
        return len(self.prompts)

    def lengths_PN(self) -> torch.Tensor:
        """Sampled tokens of each sample (stop tokens included, an environment's not)."""
        return torch.tensor([[s.sampled_tokens for s in g] for g in self.completions.samples])

    def truncated_PN(self) -> torch.Tensor:
        """True for each sample cut by max_tokens, or an episode by its limits (finish_reason
        "length")."""
        samples = self.completions.samples
        return torch.tensor([[s.finish_reason == "length" for s in g] for g in samples])

    def zero_variance_P(self) -> torch.Tensor:
        """True for each group whose rewards are all equal: no learning signal."""
        return zero_variance_P(self.rewards_PN)

    def groups(self, keep_P: torch.Tensor) -> "Rollouts":
        """The groups where `keep_P` is true, in order (counts not carried)."""
        index = keep_P.nonzero().flatten().tolist()
        return Rollouts(
            prompts=[self.prompts[i] for i in index],
            completions=Completions(
                prompts=[self.completions.prompts[i] for i in index],
                samples=[self.completions.samples[i] for i in index],
            ),
            rewards_PN=self.rewards_PN[keep_P],
        )

    @staticmethod
    def cat(parts: list["Rollouts"]) -> "Rollouts":
        """The groups of every part, in order; counts add up."""
        return Rollouts(
            prompts=[p for part in parts for p in part.prompts],
            completions=Completions(
                prompts=[p for part in parts for p in part.completions.prompts],
                samples=[g for part in parts for g in part.completions.samples],
            ),
            rewards_PN=torch.cat([part.rewards_PN for part in parts]),
            rounds=sum(part.rounds for part in parts),
            parts=sum(part.parts for part in parts),
            generated_groups=sum(part.generated_groups or len(part) for part in parts),
            short_groups=sum(part.short_groups for part in parts),
            env_s=sum(part.env_s for part in parts),
        )


def fill_informative(rounds: list[Rollouts], wanted: int) -> Rollouts:
    """Dynamic sampling: the first `wanted` groups with learning signal over `rounds`, topped
    up with groups without (short_groups counts them) when there are not enough."""
    generated = Rollouts.cat(rounds)
    informative_P = ~generated.zero_variance_P()
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
