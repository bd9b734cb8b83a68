"""The policy loss against TRL's GRPOTrainer loss on identical random inputs.

    .venv/bin/python -m pytest tests/unit/test_trl_parity.py

TRL's loss lives in `GRPOTrainer._compute_loss(self, model, inputs)`, which reads its options
from `self` and gets the per-token logprobs from a model forward. The test calls that very
function on a stand-in `self` whose forward returns the given logprobs: the only fake is the
model, and every line of TRL's loss arithmetic runs. Loss and gradient must agree within 1e-6.
Shapes: B sequences, P prompt tokens, C completion tokens, T = P + C.
"""

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from torchtitan_rl.algorithms.losses import PolicyLoss
from torchtitan_rl.algorithms.offpolicy import OffPolicyCorrection
from torchtitan_rl.types import LossScale, RolloutBatch

grpo_trainer = pytest.importorskip("trl.trainer.grpo_trainer")

B, P, C = 6, 3, 7

# Our aggregation -> TRL's loss_type.
TRL_LOSS_TYPE = {
    "token_mean": "dapo",
    "seq_mean_token_mean": "grpo",
    "seq_mean_token_sum": "luspo",
    "constant": "dr_grpo",
}


class TRLSelf:
    """What GRPOTrainer._compute_loss reads from `self`, with a forward that returns
    `logprobs_BC` (the model is the one thing faked: no model runs here)."""

    aux_loss_enabled = False
    top_entropy_quantile = 1.0
    off_policy_mask_threshold = None
    _entropy_bonus_enabled = False
    current_gradient_accumulation_steps = 1

    def __init__(self, logprobs_BC, *, loss_type, level, eps_low, eps_high, delta, beta, is_on):
        self.logprobs_BC = logprobs_BC
        self.loss_type, self.importance_sampling_level = loss_type, level
        self.epsilon_low, self.epsilon_high, self.beta = eps_low, eps_high, beta
        self.max_completion_length = C
        self.use_vllm = self.vllm_importance_sampling_correction = is_on
        self.model = SimpleNamespace(training=True)
        self.args = SimpleNamespace(
            delta=delta, use_bias_correction_kl=False, steps_per_generation=1
        )
        self.accelerator = SimpleNamespace(
            num_processes=1,
            sync_gradients=True,
            gather=lambda x: x,
            gather_for_metrics=lambda x: x,
            reduce=lambda x, reduction: x,
        )
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        return self.logprobs_BC, torch.zeros_like(self.logprobs_BC), None


def random_inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    old_BC = -torch.rand(B, C, generator=g) * 3
    # Ratios spread over about [0.4, 2.2]: many tokens fall outside any clip range.
    current_BC = old_BC + torch.randn(B, C, generator=g) * 0.4
    behaviour_BC = old_BC + torch.randn(B, C, generator=g) * 0.2
    reference_BC = old_BC + torch.randn(B, C, generator=g) * 0.3
    advantages_B = torch.randn(B, generator=g)
    lengths_B = torch.randint(1, C + 1, (B,), generator=g)
    mask_BC = (torch.arange(C)[None, :] < lengths_B[:, None]).float()
    return old_BC, current_BC, behaviour_BC, reference_BC, advantages_B, mask_BC


def prompt_padded(x_BC: torch.Tensor) -> torch.Tensor:
    """Our tensors span prompt + completion; the prompt columns are outside the loss."""
    return torch.cat([torch.zeros(B, P), x_BC], dim=1)


CASES = [
    # name, aggregation, ratio level, clip (low, high), dual clip, KL beta, off-policy correction
    ("grpo", "seq_mean_token_mean", "token", (0.2, 0.2), 0.0, 0.0, None),
    ("dapo", "token_mean", "token", (0.2, 0.28), 0.0, 0.0, None),
    ("dr_grpo", "constant", "token", (0.2, 0.2), 0.0, 0.0, None),
    ("seq_mean_token_sum", "seq_mean_token_sum", "token", (0.2, 0.2), 0.0, 0.0, None),
    ("gspo", "seq_mean_token_mean", "sequence", (0.03, 0.04), 0.0, 0.0, None),
    ("gspo_token_mean", "token_mean", "sequence", (0.03, 0.04), 0.0, 0.0, None),
    ("grpo_k3", "seq_mean_token_mean", "token", (0.2, 0.2), 0.0, 0.04, None),
    ("dapo_k3", "token_mean", "token", (0.2, 0.28), 0.0, 0.1, None),
    ("gspo_k3", "seq_mean_token_mean", "sequence", (0.03, 0.04), 0.0, 0.04, None),
    ("dual_clip", "token_mean", "token", (0.2, 0.2), 1.5, 0.0, None),
    ("tis_token", "token_mean", "token", (0.2, 0.28), 0.0, 0.0, ("tis", "token", 0.0, 1.2)),
    ("mis_token", "seq_mean_token_mean", "token", (0.2, 0.2), 0.0, 0.0, ("mis", "token", 0.8, 1.2)),
    ("tis_sequence", "token_mean", "token", (0.2, 0.2), 0.0, 0.04, ("tis", "sequence", 0.0, 2.0)),
    ("mis_sequence", "constant", "token", (0.2, 0.2), 0.0, 0.0, ("mis", "sequence", 0.5, 2.0)),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_loss_and_gradient_equal_trl(case, seed):
    _, aggregation, level, (low, high), dual_clip, beta, offpolicy = case
    old_BC, current_BC, behaviour_BC, reference_BC, advantages_B, mask_BC = random_inputs(seed)
    correction = OffPolicyCorrection(*offpolicy) if offpolicy else OffPolicyCorrection()

    # Ours, over prompt + completion columns.
    ours_BC = current_BC.clone().requires_grad_()
    batch = RolloutBatch(
        tokens_BT=torch.zeros(B, P + C, dtype=torch.long),
        loss_mask_BT=prompt_padded(mask_BC),
        advantages_B=advantages_B,
        generator_logprobs_BT=prompt_padded(behaviour_BC),
        reference_logprobs_BT=prompt_padded(reference_BC),
        old_logprobs_BT=prompt_padded(old_BC),
    )
    loss_fn = PolicyLoss(
        level=level,
        clip_low=low,
        clip_high=high,
        clip_ratio_c=dual_clip,
        aggregation=aggregation,
        max_tokens=C,
        correction=correction,
        kl_beta=beta,
        kl_estimator="k3",
    )
    scale = LossScale(tokens=int(mask_BC.sum()), sequences=B)
    ours, _ = loss_fn(torch.cat([torch.zeros(B, P), ours_BC], dim=1), batch, scale)
    ours.backward()

    # TRL's, over the completion columns.
    theirs_BC = current_BC.clone().requires_grad_()
    trl_self = TRLSelf(
        theirs_BC,
        loss_type=TRL_LOSS_TYPE[aggregation],
        level=level,
        eps_low=low,
        eps_high=high,
        delta=dual_clip or None,
        beta=beta,
        is_on=offpolicy is not None,
    )
    inputs = {
        "prompt_ids": torch.zeros(B, P, dtype=torch.long),
        "prompt_mask": torch.ones(B, P, dtype=torch.long),
        "completion_ids": torch.zeros(B, C, dtype=torch.long),
        "completion_mask": mask_BC,
        "advantages": advantages_B,
        "old_per_token_logps": old_BC,
        "ref_per_token_logps": reference_BC,
        "num_items_in_batch": mask_BC.sum(),
    }
    if offpolicy is not None:
        # TRL computes this weight while generating, from the same two logprobs.
        ratio = correction.ratios(old_BC, behaviour_BC, mask_BC)  # [B, C], or [B, 1]
        inputs["importance_sampling_ratio"] = correction.weights(ratio)
    theirs = grpo_trainer.GRPOTrainer._compute_loss(trl_self, None, inputs)
    theirs.backward()

    assert abs(ours.item() - theirs.item()) <= 1e-6, (ours.item(), theirs.item())
    torch.testing.assert_close(ours_BC.grad, theirs_BC.grad, atol=1e-6, rtol=0)
    assert ours_BC.grad.abs().sum() > 0  # a gradient flowed: the comparison means something


def test_the_inputs_leave_the_clip_range():
    """The random ratios reach both sides of every clip range above, per token and per
    sequence (else clipping would be compared on nothing)."""
    for seed in (0, 1, 2):
        old_BC, current_BC, *_, mask_BC = random_inputs(seed)
        log_ratio_BC = (current_BC - old_BC) * mask_BC
        ratios = torch.exp(log_ratio_BC)[mask_BC.bool()]
        assert (ratios < 0.8).any() and (ratios > 1.28).any() and (ratios > 1.5).any()
        sequence_B = torch.exp(log_ratio_BC.sum(1) / mask_BC.sum(1))
        assert (sequence_B < 0.97).any() and (sequence_B > 1.04).any()
