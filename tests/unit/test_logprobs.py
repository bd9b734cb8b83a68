"""token_logprobs: next-token shift, temperature, chunking, gradients, entropy; RolloutBatch.

.venv/bin/python -m pytest tests/unit/test_logprobs.py
"""

import pytest
import torch

from torchtitan_rl.trainer.logprobs import token_logprobs
from torchtitan_rl.types import RolloutBatch


def test_logits_at_t_score_token_t_plus_1():
    # A "model" whose logits at position t put all mass on tokens[t + 1].
    tokens_BT = torch.tensor([[3, 1, 4, 1, 5]])
    logits_BTV = torch.full((1, 5, 8), -1e4)
    for t in range(4):
        logits_BTV[0, t, tokens_BT[0, t + 1]] = 0.0
    logprobs_BT, _ = token_logprobs(logits_BTV, tokens_BT)
    assert logprobs_BT.shape == (1, 5)
    assert logprobs_BT[0, 0] == 0.0  # nothing predicts the first token
    assert torch.allclose(logprobs_BT[0, 1:], torch.zeros(4))
    # Reading the logits at the token's own position instead (the classic bug) is far off.
    unshifted = torch.log_softmax(logits_BTV, -1).gather(-1, tokens_BT[..., None])[..., 0]
    assert (unshifted[0, :4] < -1e3).all()


def reference(logits_BTV, tokens_BT, temperature):
    logp_BTV = torch.log_softmax(logits_BTV[:, :-1].float() / temperature, dim=-1)
    picked_BT = logp_BTV.gather(-1, tokens_BT[:, 1:, None]).squeeze(-1)
    entropy_BT = -(logp_BTV.exp() * logp_BTV).sum(-1)
    return picked_BT, entropy_BT


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_elements", [1, 2 * 16 * 3, 2**26])
def test_matches_log_softmax_of_scaled_logits_for_any_chunking(temperature, chunk_elements):
    g = torch.Generator().manual_seed(0)
    logits_BTV = torch.randn(2, 7, 16, generator=g) * 3
    tokens_BT = torch.randint(0, 16, (2, 7), generator=g)
    logprobs_BT, entropy_BT = token_logprobs(
        logits_BTV, tokens_BT, temperature, with_entropy=True, chunk_elements=chunk_elements
    )
    expected_BT, expected_entropy_BT = reference(logits_BTV, tokens_BT, temperature)
    torch.testing.assert_close(logprobs_BT[:, 1:], expected_BT, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(entropy_BT[:, 1:], expected_entropy_BT, rtol=1e-6, atol=1e-6)
    assert (entropy_BT[:, 0] == 0).all()


def test_chunking_is_bitwise_neutral():
    g = torch.Generator().manual_seed(1)
    logits_BTV = torch.randn(3, 9, 32, generator=g)
    tokens_BT = torch.randint(0, 32, (3, 9), generator=g)
    whole, _ = token_logprobs(logits_BTV, tokens_BT, 0.9)
    for chunk_elements in (1, 3 * 32 * 2, 3 * 32 * 5):
        chunked, _ = token_logprobs(logits_BTV, tokens_BT, 0.9, chunk_elements=chunk_elements)
        assert torch.equal(chunked, whole)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradient_through_checkpointed_chunks_equals_direct(dtype):
    g = torch.Generator().manual_seed(2)
    base = torch.randn(2, 6, 16, generator=g).to(dtype)
    tokens_BT = torch.randint(0, 16, (2, 6), generator=g)
    weights_BT = torch.randn(2, 6, generator=g)

    chunked = base.clone().requires_grad_()
    logprobs_BT, _ = token_logprobs(chunked, tokens_BT, 0.8, chunk_elements=2 * 16)
    (logprobs_BT * weights_BT).sum().backward()

    direct = base.clone().requires_grad_()
    expected_BT, _ = reference(direct, tokens_BT, 0.8)
    (expected_BT * weights_BT[:, 1:]).sum().backward()
    assert logprobs_BT.dtype == torch.float32
    torch.testing.assert_close(chunked.grad, direct.grad, rtol=1e-5, atol=1e-6)


def test_rollout_batch_splits_rows_in_order():
    batch = RolloutBatch(
        tokens_BT=torch.arange(10).view(5, 2),
        loss_mask_BT=torch.ones(5, 2),
        advantages_B=torch.arange(5.0),
        generator_logprobs_BT=torch.zeros(5, 2),
    )
    parts = batch.split(2)
    assert [p.batch_size for p in parts] == [3, 2]
    assert torch.equal(torch.cat([p.advantages_B for p in parts]), batch.advantages_B)
    assert torch.equal(parts[1].tokens_BT, torch.tensor([[6, 7], [8, 9]]))
    with pytest.raises(ValueError, match="cannot split 5 sequences into 6"):
        batch.split(6)
