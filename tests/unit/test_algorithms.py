"""Advantages and losses against small hand-computed examples.

.venv/bin/python -m pytest tests/unit/test_algorithms.py
"""

import math
import typing

import pytest
import torch

from torchtitan_rl.algorithms import registry
from torchtitan_rl.algorithms.advantages import build_advantage, zero_variance_P
from torchtitan_rl.algorithms.advantages.dr_grpo import DrGRPOAdvantage
from torchtitan_rl.algorithms.advantages.grpo import GRPOAdvantage
from torchtitan_rl.algorithms.advantages.rloo import RLOOAdvantage
from torchtitan_rl.algorithms.dynamic_sampling import fill_informative
from torchtitan_rl.algorithms.losses import PolicyLoss, build_loss, kl_penalty
from torchtitan_rl.algorithms.offpolicy import OffPolicyCorrection
from torchtitan_rl.config import AlgorithmSection
from torchtitan_rl.config.algorithm import PRESET_FIELDS
from torchtitan_rl.types import Completions, LossScale, Prompt, RolloutBatch, Rollouts

REWARDS_PN = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])


def test_grpo_normalizes_by_group_mean_and_sample_std():
    out = GRPOAdvantage()(REWARDS_PN)
    # mean 0.5, sample std sqrt(4 * 0.25 / 3) = 0.57735
    expected = 0.5 / math.sqrt(1 / 3)
    torch.testing.assert_close(
        out[0],
        torch.tensor([expected, -expected, -expected, expected]),
        atol=1e-5,
        rtol=0,
    )
    assert torch.equal(out[1], torch.zeros(4))
    assert zero_variance_P(REWARDS_PN).tolist() == [False, True]


def test_dr_grpo_subtracts_the_mean_only():
    out = DrGRPOAdvantage()(REWARDS_PN)
    assert out.tolist() == [[0.5, -0.5, -0.5, 0.5], [0.0] * 4]


def test_rloo_leaves_one_out():
    out = RLOOAdvantage()(REWARDS_PN)
    torch.testing.assert_close(out[0], torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3]))
    assert out[1].abs().max() == 0


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


def ppo(**kwargs) -> PolicyLoss:
    options = {"clip_low": 0.2, "clip_high": 0.2, "aggregation": "token_mean", "max_tokens": 4}
    return PolicyLoss(**(options | kwargs))


@pytest.mark.parametrize(
    "aggregation, loss, grad",
    [
        # token_mean: -(2 + 2 - 1) / 3 tokens; each token's gradient -A / 3
        ("token_mean", -1.0, [[0, -2 / 3, -2 / 3], [0, 1 / 3, 0]]),
        # seq_mean_token_mean: (mean(-2, -2) + mean(1)) / 2 sequences
        ("seq_mean_token_mean", -0.5, [[0, -0.5, -0.5], [0, 0.5, 0]]),
        # seq_mean_token_sum: (sum(-2, -2) + sum(1)) / 2 sequences
        ("seq_mean_token_sum", -1.5, [[0, -1.0, -1.0], [0, 0.5, 0]]),
        # constant (Dr. GRPO): -3 / (2 sequences * 4 max tokens)
        ("constant", -0.375, [[0, -0.25, -0.25], [0, 0.125, 0]]),
    ],
)
def test_aggregations(aggregation, loss, grad):
    value, gradient, metrics = loss_and_grad(ppo(clip_high=0.28, aggregation=aggregation))
    assert value == pytest.approx(loss)
    torch.testing.assert_close(gradient, torch.tensor(grad))
    assert metrics == {"clipped_tokens": 0.0}  # no old logprobs given: the ratio is 1


def ratio_batch(ratios_BT, advantages_B, old=-1.0) -> tuple[torch.Tensor, RolloutBatch]:
    """Current logprobs whose ratio to the old ones (all `old`) is `ratios_BT`, every token
    sampled."""
    ratios_BT = torch.tensor(ratios_BT)
    logprobs_BT = (old + ratios_BT.log()).requires_grad_()
    b = RolloutBatch(
        tokens_BT=torch.zeros(ratios_BT.shape, dtype=torch.long),
        loss_mask_BT=torch.ones(ratios_BT.shape),
        advantages_B=torch.tensor(advantages_B),
        generator_logprobs_BT=torch.full(ratios_BT.shape, old),
        old_logprobs_BT=torch.full(ratios_BT.shape, old),
    )
    return logprobs_BT, b


def test_ppo_clip_bounds_and_clip_fraction():
    # Clip range [0.8, 1.28] (DAPO's clip-higher). A = +1: ratio 0.5 is inside the objective's
    # pessimistic bound (-0.5, gradient -r), ratio 1.5 is clipped to 1.28 (no gradient).
    # A = -1: ratio 0.5 is clipped to 0.8 (no gradient), ratio 1.5 is not (loss r, grad r).
    logprobs_BT, b = ratio_batch([[0.5, 1.5], [0.5, 1.5]], [1.0, -1.0])
    loss, metrics = ppo(clip_high=0.28)(logprobs_BT, b, LossScale(tokens=4, sequences=2))
    loss.backward()
    assert loss.item() == pytest.approx((-0.5 - 1.28 + 0.8 + 1.5) / 4)
    torch.testing.assert_close(logprobs_BT.grad, torch.tensor([[-0.5, 0.0], [0.0, 1.5]]) / 4)
    assert metrics["clipped_tokens"] == 2.0


def test_dual_clip_caps_negative_advantage_losses():
    # A = -1, ratio 4: PPO's loss is 4 (unbounded in the ratio); dual clip c = 3 caps it at 3
    # with no gradient. Ratio 2 stays under the cap; A = +1 tokens are never dual-clipped.
    logprobs_BT, b = ratio_batch([[4.0, 2.0], [4.0, 2.0]], [-1.0, 1.0])
    loss, metrics = ppo(clip_ratio_c=3.0)(logprobs_BT, b, LossScale(tokens=4, sequences=2))
    loss.backward()
    assert loss.item() == pytest.approx((3.0 + 2.0 - 1.2 - 1.2) / 4)
    torch.testing.assert_close(logprobs_BT.grad, torch.tensor([[0.0, 2.0], [0.0, 0.0]]) / 4)
    assert metrics == {"clipped_tokens": 2.0, "dual_clipped_tokens": 1.0}


def test_gspo_uses_one_ratio_per_sequence():
    # Sequence 0: log ratios 0.2 and -0.1, s = exp(0.05) = 1.051 > 1 + 4e-4: clipped, no
    # gradient. Sequence 1: log ratios +-1e-4, s = 1: each token's gradient -A * s / length.
    logprobs_BT, b = ratio_batch(
        [[math.exp(0.2), math.exp(-0.1)], [math.exp(1e-4), math.exp(-1e-4)]], [1.0, 1.0]
    )
    fn = ppo(level="sequence", clip_low=3e-4, clip_high=4e-4, aggregation="seq_mean_token_mean")
    loss, metrics = fn(logprobs_BT, b, LossScale(tokens=4, sequences=2))
    loss.backward()
    assert loss.item() == pytest.approx((-(1 + 4e-4) - 1.0) / 2)
    torch.testing.assert_close(logprobs_BT.grad, torch.tensor([[0.0, 0.0], [-0.25, -0.25]]))
    assert metrics["clipped_tokens"] == 2.0  # both tokens of sequence 0


# Trainer (old) logprob -1 everywhere; the generator said -2 (ratio e) and -0.5 (ratio e^-0.5).
BEHAVIOUR = torch.tensor([[0.0, -2.0, -0.5], [0.0, -1.0, 0.0]])


@pytest.mark.parametrize(
    "mode, level, ratio_min, weights",
    [
        # Truncated to [0, 2]: e -> 2.
        ("tis", "token", 0.0, [2.0, math.exp(-0.5), 1.0]),
        # Masked outside [0.7, 2]: e and e^-0.5 = 0.61 leave the loss.
        ("mis", "token", 0.7, [0.0, 0.0, 1.0]),
        # Masked outside [0.5, 2]: e leaves it, 0.61 keeps its weight.
        ("mis", "token", 0.5, [0.0, math.exp(-0.5), 1.0]),
        # Sequence 0's ratio is the product e^0.5 = 1.65, inside [0, 2]: both tokens weigh it.
        ("tis", "sequence", 0.0, [math.exp(0.5), math.exp(0.5), 1.0]),
    ],
)
def test_offpolicy_correction_weights_tokens_by_old_over_behaviour(mode, level, ratio_min, weights):
    correction = OffPolicyCorrection(mode=mode, level=level, ratio_min=ratio_min, ratio_max=2.0)
    value, gradient, _ = loss_and_grad(ppo(correction=correction), BEHAVIOUR)
    w0, w1, w2 = weights
    assert value == pytest.approx(-(2 * w0 + 2 * w1 - 1 * w2) / 3)
    torch.testing.assert_close(
        gradient, torch.tensor([[0, -2 * w0 / 3, -2 * w1 / 3], [0, w2 / 3, 0]])
    )


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
    fn = ppo(kl_beta=0.5, kl_estimator="k1")
    loss, metrics = fn(logprobs_BT, b, SCALE)
    assert loss.item() == pytest.approx(-1.0 + 0.5 * 1.0)  # pg -1, k1 = 1 on every token
    assert metrics["kl_sum"] == pytest.approx(3.0)


def test_dynamic_sampling_keeps_informative_groups_first():
    def rollouts(rewards):
        rewards_PN = torch.tensor(rewards)
        prompts = [Prompt(text=f"p{r}", answer="") for r in rewards_PN[:, 0].tolist()]
        completions = Completions(prompts=[[1]] * len(prompts), samples=[[]] * len(prompts))
        return Rollouts(prompts, completions, rewards_PN)

    first = rollouts([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0]])
    second = rollouts([[0.5, 0.0], [1.0, 1.0], [0.25, 0.0]])
    kept = fill_informative([first, second], wanted=3)
    # The three informative groups, in generation order; none short.
    assert kept.rewards_PN.tolist() == [[0.0, 1.0], [0.5, 0.0], [0.25, 0.0]]
    assert (kept.rounds, kept.generated_groups, kept.short_groups) == (2, 6, 0)
    # One round only: one informative group, topped up with the first two flat ones.
    short = fill_informative([first], wanted=3)
    assert short.rewards_PN.tolist() == first.rewards_PN.tolist()
    assert (short.rounds, short.generated_groups, short.short_groups) == (1, 3, 2)


def test_overlong_modes_change_the_rewards_or_the_mask_as_specified():
    from torchtitan_rl.algorithms.overlong import overlong_keep_PN, overlong_rewards
    from torchtitan_rl.types import Sample

    # One prompt, 4 samples of max_tokens = 8: lengths 2, 5, 7 (stopped) and 8 (cut).
    lengths = [2, 5, 7, 8]
    samples = [
        Sample(token_ids=[9] * n, logprobs=[-1.0] * n, finish_reason="length" if n == 8 else "stop")
        for n in lengths
    ]
    rollouts = Rollouts(
        [Prompt(text="p", answer="a")],
        Completions(prompts=[[1]], samples=[samples]),
        rewards_PN=torch.ones(1, 4),
    )
    truncated_PN = rollouts.truncated_PN()
    assert truncated_PN.tolist() == [[False, False, False, True]]
    assert rollouts.lengths_PN().tolist() == [lengths]

    def shaped(mode, buffer=None):
        args = (rollouts.rewards_PN, rollouts.lengths_PN(), truncated_PN, mode, 8, buffer)
        return overlong_rewards(*args).tolist()

    assert shaped("keep") == shaped("mask") == [[1.0, 1.0, 1.0, 1.0]]
    assert shaped("zero_reward") == [[1.0, 1.0, 1.0, 0.0]]
    # DAPO: buffer 4 -> no penalty up to 8 - 4 = 4 tokens, then -(L - 4) / 4, -1 at 8.
    assert shaped("soft_penalty", buffer=4) == [[1.0, 0.75, 0.25, 0.0]]
    assert overlong_keep_PN(truncated_PN, "mask").tolist() == [[True, True, True, False]]
    for mode in ("keep", "zero_reward", "soft_penalty"):
        assert overlong_keep_PN(truncated_PN, mode).all()


def test_the_config_s_choices_are_the_registered_modules_and_each_is_whole():
    """Adding an estimator or a loss is one module (algorithms/registry.py): the config offers
    exactly the modules there, and each has what the registry promises."""
    fields = AlgorithmSection.__dataclass_fields__
    assert typing.get_args(fields["advantage"].type) == registry.names("advantage")
    assert typing.get_args(fields["loss"].type) == registry.names("loss")
    assert {"grpo", "dr_grpo", "rloo"} <= set(registry.names("advantage"))
    assert {"grpo", "dapo", "gspo"} <= set(registry.names("loss"))
    for name in registry.names("advantage"):
        module = registry.load("advantage", name)
        assert isinstance(module.COMPARES_GROUP, bool), name
        assert build_advantage(name)(REWARDS_PN).shape == REWARDS_PN.shape, name
    for name in registry.names("loss"):
        assert tuple(registry.load("loss", name).PRESET) == PRESET_FIELDS, name
        algorithm = AlgorithmSection(loss=name)
        algorithm.resolve()
        loss = build_loss(algorithm, max_tokens=2)
        value, metrics = loss(torch.full((2, 3), -1.0), batch(), SCALE)
        assert value.dim() == 0 and set(metrics) <= set(loss.TOKEN_METRICS.values()), name
