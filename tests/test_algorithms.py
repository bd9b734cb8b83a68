"""Advantages and losses against small hand-computed examples.

.venv/bin/python -m pytest tests/test_algorithms.py
"""

import math

import pytest
import torch

from torchtitan_rl.algorithms.advantages import DrGRPOAdvantage, GRPOAdvantage, RLOOAdvantage
from torchtitan_rl.algorithms.losses import GSPOLoss, PPOClipLoss, kl_penalty
from torchtitan_rl.batch import RolloutBatch
from torchtitan_rl.trainer.policy_trainer import LossScale

REWARDS_PN = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])


def test_grpo_normalizes_by_group_mean_and_sample_std():
    out = GRPOAdvantage()(REWARDS_PN)
    # mean 0.5, sample std sqrt(4 * 0.25 / 3) = 0.57735
    expected = 0.5 / math.sqrt(1 / 3)
    torch.testing.assert_close(
        out.values_PN[0],
        torch.tensor([expected, -expected, -expected, expected]),
        atol=1e-5,
        rtol=0,
    )
    assert torch.equal(out.values_PN[1], torch.zeros(4))
    assert out.zero_variance_PN.tolist() == [[False] * 4, [True] * 4]


def test_dr_grpo_subtracts_the_mean_only():
    out = DrGRPOAdvantage()(REWARDS_PN)
    assert out.values_PN.tolist() == [[0.5, -0.5, -0.5, 0.5], [0.0] * 4]


def test_rloo_leaves_one_out():
    out = RLOOAdvantage()(REWARDS_PN)
    torch.testing.assert_close(out.values_PN[0], torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3]))
    assert out.values_PN[1].abs().max() == 0


def batch(generator_logprobs=None) -> RolloutBatch:
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    return RolloutBatch(
        tokens_BT=torch.zeros(2, 3, dtype=torch.long),
        loss_mask_BT=mask,
        advantages_B=torch.tensor([2.0, -1.0]),
        generator_logprobs_BT=generator_logprobs if generator_logprobs is not None else mask * 0,
    )


SCALE = LossScale(tokens=3, sequences=2)


def loss_and_grad(loss_fn, generator_logprobs=None):
    logprobs_BT = torch.full((2, 3), -1.0, requires_grad=True)
    loss, metrics = loss_fn(logprobs_BT, batch(generator_logprobs), SCALE)
    loss.backward()
    return loss.item(), logprobs_BT.grad, metrics


@pytest.mark.parametrize(
    "aggregation, loss, grad",
    [
        # token_mean: -(2 + 2 - 1) / 3 tokens; each token's gradient -A / 3
        ("token_mean", -1.0, [[0, -2 / 3, -2 / 3], [0, 1 / 3, 0]]),
        # sequence_mean: (mean(-2, -2) + mean(1)) / 2 sequences
        ("sequence_mean", -0.5, [[0, -0.5, -0.5], [0, 0.5, 0]]),
        # constant (Dr. GRPO): -3 / (2 sequences * 4 max tokens)
        ("constant", -0.375, [[0, -0.25, -0.25], [0, 0.125, 0]]),
    ],
)
def test_ppo_clip_loss_aggregations(aggregation, loss, grad):
    fn = PPOClipLoss(clip_low=0.2, clip_high=0.28, aggregation=aggregation, max_tokens=4)
    value, gradient, metrics = loss_and_grad(fn)
    assert value == pytest.approx(loss)
    torch.testing.assert_close(gradient, torch.tensor(grad))
    assert metrics == {"clipped_tokens": 0.0}  # one update per batch: the ratio starts at 1


def test_tis_weights_tokens_by_the_capped_trainer_generator_ratio():
    # Trainer logprob -1 everywhere; the generator said -2 (ratio e) and -0.5 (ratio e^-0.5).
    generator = torch.tensor([[0.0, -2.0, -0.5], [0.0, -1.0, 0.0]])
    fn = PPOClipLoss(
        clip_low=0.2, clip_high=0.2, aggregation="token_mean", max_tokens=4, tis_cap=2.0
    )
    value, gradient, _ = loss_and_grad(fn, generator)
    weights = [2.0, math.exp(-0.5), 1.0]  # e capped at 2
    assert value == pytest.approx(-(2 * weights[0] + 2 * weights[1] - 1 * weights[2]) / 3)
    torch.testing.assert_close(
        gradient, torch.tensor([[0, -2 * weights[0] / 3, -2 * weights[1] / 3], [0, 1 / 3, 0]])
    )


def test_gspo_uses_one_ratio_per_sequence():
    value, gradient, _ = loss_and_grad(GSPOLoss(clip_low=3e-4, clip_high=4e-4))
    assert value == pytest.approx(-(2.0 - 1.0) / 2)
    # d/dlogp of exp(mean over the sequence's tokens): -A / length / sequences
    torch.testing.assert_close(gradient, torch.tensor([[0, -0.5, -0.5], [0, 0.5, 0]]))


@pytest.mark.parametrize(
    "estimator, value, grad",
    # policy logprob -1, reference -2: r = -1
    [("k1", 1.0, 1.0), ("k2", 0.5, 1.0), ("k3", math.exp(-1), 1 - math.exp(-1))],
)
def test_kl_estimators(estimator, value, grad):
    logprobs = torch.tensor([-1.0], requires_grad=True)
    kl = kl_penalty(logprobs, torch.tensor([-2.0]), estimator)
    kl.sum().backward()
    assert kl.item() == pytest.approx(value)
    assert logprobs.grad.item() == pytest.approx(grad)


def test_kl_penalty_joins_the_token_loss():
    logprobs_BT = torch.full((2, 3), -1.0, requires_grad=True)
    b = batch()
    b.reference_logprobs_BT = torch.full((2, 3), -2.0)
    fn = PPOClipLoss(
        clip_low=0.2,
        clip_high=0.2,
        aggregation="token_mean",
        max_tokens=4,
        kl_beta=0.5,
        kl_estimator="k1",
    )
    loss, metrics = fn(logprobs_BT, b, SCALE)
    assert loss.item() == pytest.approx(-1.0 + 0.5 * 1.0)  # pg -1, k1 = 1 on every token
    assert metrics["kl_sum"] == pytest.approx(3.0)
