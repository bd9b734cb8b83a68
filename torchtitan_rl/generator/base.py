"""The Generator protocol: what the rest of the package asks of a generator, which both the
in-process engine (engine.LocalGenerator) and one in a child process (remote.RemoteGenerator)
give. Episodes, the producer, evaluation, the request stream and the weight transports take a
`Generator`.

    .venv/bin/python -m pytest tests/unit/test_generator.py
"""

from collections.abc import Sequence
from typing import Protocol

import torch

from torchtitan_rl.types import Completions, Delta, Images


class Generator(Protocol):
    policy_version: int
    """The version of the weights it samples with (set by the weight transport)."""

    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        *,
        n: int | None = None,
        temperature: float | None = None,
        max_tokens: int | Sequence[int] | None = None,
        seed: int | Sequence[int] | None = None,
    ) -> Completions:
        """`n` samples of each prompt, until all are done (seeded per request)."""

    def submit(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        *,
        seed: int,
        max_tokens: int,
        temperature: float | None = None,
        images: Images | None = None,
    ) -> None:
        """Add one sample's request, stepped by `step_outputs` (stream.RequestStream);
        `images`: the prompt's (None: a text prompt)."""

    def step_outputs(self) -> list[Delta]:
        """One engine step: each submitted request's new tokens, tagged with their version."""

    def abort(self, request_ids: list[str]) -> None:
        """Drop submitted requests in flight."""

    def weights(self) -> dict[str, torch.Tensor]:
        """The parameters a weight sync writes in place, by torchtitan FQN."""

    def refresh_after_weight_update(self) -> None:
        """Refresh what derives from the weights (packed copies, cached KV)."""
