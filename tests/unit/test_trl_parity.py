"""The policy loss against TRL's GRPOTrainer loss on identical random inputs.

    .venv/bin/python -m pytest tests/unit/test_trl_parity.py

TRL's loss lives in `GRPOTrainer._compute_loss(self, model, inputs)`, which reads its options
from `self` and gets the per-token logprobs from a model forward. The test calls that very
function on a stand-in `self` whose forward returns the given logprobs: the only fake is the
model, and every line of TRL's loss arithmetic runs. Loss and gradient must agree within 1e-6.

TRL computes the off-policy (vLLM importance-sampling) weight inline in
`_generate_and_score_completions`, which needs a model, vLLM and a dataset: there is no
function to call. `trl_correction_weights` runs that very block of TRL's source (cut out with
`ast`, compiled unchanged with TRL's file name and line numbers) on given logprobs, and the
off-policy loss cases feed its weight to `_compute_loss`.
Shapes: B sequences, P prompt tokens, C completion tokens, T = P + C.
"""

import ast
import inspect
import textwrap
from collections import defaultdict
from functools import cache
from types import CodeType, SimpleNamespace

import pytest
import torch

from torchtitan_rl.algorithms.losses import PolicyLoss
from torchtitan_rl.algorithms.offpolicy import OffPolicyCorrection
from torchtitan_rl.types import LossScale, RolloutBatch

# TRL's trainer module takes 3-4 s to import: only the worker that runs these tests pays it, not
# every worker's collection (all of them run on one worker: their xdist group).
pytestmark = pytest.mark.xdist_group("trl")


@cache
def grpo_trainer():
    """`trl.trainer.grpo_trainer`, imported on first use."""
    return pytest.importorskip("trl.trainer.grpo_trainer")


B, P, C = 6, 3, 7

# Our aggregation -> TRL's loss_type.
TRL_LOSS_TYPE = {
    "token_mean": "dapo",
    "seq_mean_token_mean": "grpo",
    "seq_mean_token_sum": "luspo",
    "constant": "dr_grpo",
}

# Our (offpolicy_correction, offpolicy_level) -> TRL's vllm_importance_sampling_mode.
TRL_IS_MODE = {
    ("tis", "token"): "token_truncate",
    ("tis", "sequence"): "sequence_truncate",
    ("mis", "token"): "token_mask",
    ("mis", "sequence"): "sequence_mask",
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


def assigns(node: ast.AST, name: str) -> bool:
    """Whether `name` is assigned anywhere under `node`."""
    return any(
        isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Store)
        for n in ast.walk(node)
    )


@cache
def trl_correction_code() -> CodeType:
    """The body of the `if self.use_vllm and self.vllm_importance_sampling_correction:` block of
    `GRPOTrainer._generate_and_score_completions` that assigns `vllm_importance_sampling_ratio`,
    compiled as TRL wrote it: file name and line numbers are TRL's, so a traceback points there."""
    method = grpo_trainer().GRPOTrainer._generate_and_score_completions
    lines, first_line = inspect.getsourcelines(method)
    tree = ast.parse(textwrap.dedent("".join(lines)))
    ast.increment_lineno(tree, first_line - 1)
    blocks = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.If)
        and ast.unparse(node.test) == "self.use_vllm and self.vllm_importance_sampling_correction"
        and assigns(node, "vllm_importance_sampling_ratio")
    ]
    # One block, or TRL moved the code and this test must be revisited (not silently pass).
    assert len(blocks) == 1, f"{len(blocks)} importance-sampling blocks in TRL's source"
    module = ast.Module(body=blocks[0].body, type_ignores=[])
    return compile(module, inspect.getsourcefile(method), "exec")


def trl_correction_weights(
    old_BC: torch.Tensor,
    behaviour_BC: torch.Tensor,
    mask_BC: torch.Tensor,
    *,
    mode: str,
    clip_min: float | None,
    clip_max: float | None,
) -> torch.Tensor:
    """TRL's `vllm_importance_sampling_ratio` [B, C] (token modes) or [B, 1] (sequence modes)
    from the trainer's (old) and vLLM's (behaviour) logprobs [B, C] and the completion mask
    [B, C], computed by TRL's own code (`trl_correction_code`). No tool mask: our loss mask
    already leaves environment tokens out."""
    trl_self = SimpleNamespace(
        vllm_importance_sampling_mode=mode,
        vllm_importance_sampling_clip_min=clip_min,
        vllm_importance_sampling_clip_max=clip_max,
    )
    local_names = {
        "self": trl_self,
        "old_per_token_logps": old_BC,
        "sampling_per_token_logps": behaviour_BC,
        "completion_mask": mask_BC,
        "tool_mask": None,
    }
    # TRL's module globals (its torch, math): the block runs as it would inside the method.
    exec(trl_correction_code(), dict(vars(grpo_trainer())), local_names)
    return local_names["vllm_importance_sampling_ratio"]


def trl_weights_for(
    correction: OffPolicyCorrection,
    old_BC: torch.Tensor,
    behaviour_BC: torch.Tensor,
    mask_BC: torch.Tensor,
) -> torch.Tensor:
    """TRL's weight [B, C] or [B, 1] for the TRL mode that matches `correction`, same band."""
    return trl_correction_weights(
        old_BC,
        behaviour_BC,
        mask_BC,
        mode=TRL_IS_MODE[(correction.mode, correction.level)],
        clip_min=correction.ratio_min,
        clip_max=correction.ratio_max,
    )


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
        # TRL computes this weight while generating, from the same two logprobs: its code here.
        inputs["importance_sampling_ratio"] = trl_weights_for(
            correction, old_BC, behaviour_BC, mask_BC
        )
    theirs = grpo_trainer().GRPOTrainer._compute_loss(trl_self, None, inputs)
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


def offpolicy_inputs(seed: int):
    """Trainer (old) and generator (behaviour) logprobs [B, C] and the loss mask [B, C]. The
    log ratio is token noise plus a per-sequence drift, so tokens and whole sequences land far
    above 2 and far below 0.5 as well as inside; padding carries a behaviour logprob of -30,
    so a ratio that forgot the mask would be huge."""
    g = torch.Generator().manual_seed(seed)
    old_BC = -torch.rand(B, C, generator=g) * 3
    drift_B1 = torch.tensor([-1.0, -0.5, 0.0, 0.0, 0.5, 1.0])[:, None]
    log_ratio_BC = torch.randn(B, C, generator=g) * 0.3 + drift_B1
    log_ratio_BC[0, 0], log_ratio_BC[5, 0] = -4.0, 4.0  # ratios 0.018 and 55
    lengths_B = torch.randint(3, C + 1, (B,), generator=g)
    mask_BC = (torch.arange(C)[None, :] < lengths_B[:, None]).float()
    behaviour_BC = torch.where(mask_BC.bool(), old_BC - log_ratio_BC, -30.0)
    return old_BC, behaviour_BC, mask_BC


OFFPOLICY_CASES = [
    # mode, level, ratio_min, ratio_max (ours: offpolicy_ratio_min|max; TRL: clip_min|max)
    ("tis", "token", 0.0, 2.0),  # our default band: only the cap acts
    ("tis", "token", 0.5, 2.0),
    ("tis", "sequence", 0.0, 2.0),
    ("tis", "sequence", 0.5, 2.0),
    ("mis", "token", 0.5, 2.0),
    ("mis", "sequence", 0.5, 2.0),
]


@pytest.mark.parametrize(
    "case", OFFPOLICY_CASES, ids=["-".join(map(str, c)) for c in OFFPOLICY_CASES]
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_offpolicy_weights_equal_trl(case, seed):
    """`OffPolicyCorrection.weights` equals TRL's vllm_importance_sampling_ratio (TRL's code,
    `trl_correction_weights`) within 1e-6, with the same bounds: tis = token_truncate /
    sequence_truncate (clamp to [min, max]), mis = token_mask / sequence_mask (0 outside
    [min, max], both bounds kept). Sequence level is the product over the sequence's tokens in
    both, one weight [B, 1]; padding gives ratio 1 in both. Not compared: TRL turns a NaN vLLM
    logprob into ratio 1, where we stop the run (`check_finite` on the generator's logprobs);
    mode none has no TRL counterpart to run (TRL skips the weight when the correction is off).
    The inputs make the band act: the test asserts tokens/sequences truncated or masked on each
    side it has, and others left as they were."""
    old_BC, behaviour_BC, mask_BC = offpolicy_inputs(seed)
    correction = OffPolicyCorrection(*case)
    ratio_BU = correction.ratios(old_BC, behaviour_BC, mask_BC)  # U = C, or 1 per sequence
    ours_BU = correction.weights(ratio_BU)
    theirs_BU = trl_weights_for(correction, old_BC, behaviour_BC, mask_BC)

    assert ours_BU.shape == theirs_BU.shape == ratio_BU.shape
    torch.testing.assert_close(ours_BU, theirs_BU, atol=1e-6, rtol=0)

    units_BU = mask_BC.bool() if ratio_BU.shape[1] > 1 else torch.ones(B, 1, dtype=torch.bool)
    above, below = ratio_BU > correction.ratio_max, ratio_BU < correction.ratio_min
    inside = units_BU & ~above & ~below
    assert (above & units_BU).any() and inside.any()
    assert correction.ratio_min == 0 or (below & units_BU).any()
    # Where the band acted, TRL's weight shows it; inside, it is the raw ratio.
    if correction.mode == "tis":
        assert (theirs_BU[above] == correction.ratio_max).all()
        assert (theirs_BU[below] == correction.ratio_min).all()
    else:
        assert (theirs_BU[above | below] == 0).all()
    torch.testing.assert_close(theirs_BU[inside], ratio_BU[inside], atol=1e-6, rtol=0)
    if ratio_BU.shape[1] > 1:  # padding (behaviour logprob -30) is out of the ratio: weight 1
        assert (theirs_BU[~mask_BC.bool()] == 1).all()


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_mis_keeps_ratios_on_the_bounds_like_trl(level):
    """A ratio exactly on either bound stays in the loss, in ours and in TRL's (both bounds
    inclusive: TRL masks only ratio < clip_min or ratio > clip_max)."""
    old_BC, behaviour_BC, mask_BC = offpolicy_inputs(0)
    ratio_BU = OffPolicyCorrection("mis", level).ratios(old_BC, behaviour_BC, mask_BC)
    # The band is two of the ratios themselves (exact float32 values), the smallest and largest.
    units_BU = ratio_BU if level == "sequence" else ratio_BU[mask_BC.bool()]
    lo, hi = float(units_BU.min()), float(units_BU.max())
    correction = OffPolicyCorrection("mis", level, lo, hi)
    ours_BU = correction.weights(ratio_BU)
    theirs_BU = trl_weights_for(correction, old_BC, behaviour_BC, mask_BC)
    torch.testing.assert_close(ours_BU, theirs_BU, atol=1e-6, rtol=0)
    for bound in (lo, hi):
        assert (theirs_BU[ratio_BU == bound] == bound).all() and (ratio_BU == bound).any()
