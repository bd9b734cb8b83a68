"""Per-token log-probabilities and entropy from logits, chunked over the sequence.

    .venv/bin/python -m pytest tests/unit/test_logprobs.py

Shapes: B batch, T sequence, V vocabulary, C a chunk of T.
Alignment: `logprobs_BT[:, t]` is log p(tokens[:, t] | tokens[:, :t]), read from the logits at
position t - 1 (the logits at t score token t + 1). Column 0 has no prediction and is 0.
"""

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

# At most this many fp32 elements (B * C * V) are upcast at once: 256 MiB.
CHUNK_ELEMENTS = 2**26


def _chunk_logprobs(logits_BCV: torch.Tensor, targets_BC: torch.Tensor, temperature: float):
    scaled_BCV = logits_BCV.float()
    if temperature != 1.0:
        scaled_BCV = scaled_BCV / temperature
    # log_softmax, then pick: the very ops vLLM reports processed logprobs with, so equal logits
    # give bitwise-equal logprobs (picked - logsumexp rounds differently).
    logp_BCV = torch.log_softmax(scaled_BCV, dim=-1)
    return logp_BCV.gather(-1, targets_BC.unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def _chunk_entropy(logits_BCV: torch.Tensor, temperature: float) -> torch.Tensor:
    logp_BCV = torch.log_softmax(logits_BCV.float() / temperature, dim=-1)
    return -(logp_BCV.exp() * logp_BCV).sum(-1)


def token_logprobs(
    logits_BTV: torch.Tensor,
    tokens_BT: torch.Tensor,
    temperature: float = 1.0,
    *,
    with_entropy: bool = False,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities of `tokens_BT` under `logits_BTV / temperature`, fp32, [B, T].

    Works chunk by chunk over T so that at most one fp32 [B, C, V] copy exists at a time; under
    autograd each chunk is recomputed in backward instead of saving its fp32 copy, so the only
    [B, T, V] tensor kept is `logits_BTV` itself. With `with_entropy`, also returns the entropy
    of each position's predictive distribution (no gradient), aligned like the logprobs.
    """
    B, T, V = logits_BTV.shape
    chunk = max(1, chunk_elements // max(1, B * V))
    logits_BTV, targets_BT = logits_BTV[:, :-1], tokens_BT[:, 1:]
    pieces, entropies = [], []
    for start in range(0, T - 1, chunk):
        logits_BCV = logits_BTV[:, start : start + chunk]
        targets_BC = targets_BT[:, start : start + chunk]
        if torch.is_grad_enabled() and logits_BCV.requires_grad:
            piece = checkpoint(
                _chunk_logprobs, logits_BCV, targets_BC, temperature, use_reentrant=False
            )
        else:
            piece = _chunk_logprobs(logits_BCV, targets_BC, temperature)
        pieces.append(piece)
        if with_entropy:
            entropies.append(_chunk_entropy(logits_BCV, temperature))
    logprobs_BT = F.pad(torch.cat(pieces, dim=1), (1, 0))
    entropy_BT = F.pad(torch.cat(entropies, dim=1), (1, 0)) if with_entropy else None
    return logprobs_BT, entropy_BT
