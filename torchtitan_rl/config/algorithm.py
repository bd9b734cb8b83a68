"""The [algorithm] section: advantage estimator, policy loss and its presets, KL, off-policy
correction and overlong handling.

    .venv/bin/python -m pytest tests/unit/test_config.py tests/unit/test_algorithms.py

`resolve()` fills the fields left unset (from algorithm.loss's module's PRESET and the other
defaults their docstrings name); `validate()` then only checks.
"""

from dataclasses import dataclass
from typing import Literal

from torchtitan_rl.algorithms import registry
from torchtitan_rl.config.errors import require

# The [algorithm] fields each loss's PRESET sets where they are left unset (algorithms/losses/).
PRESET_FIELDS = ("clip_eps_low", "clip_eps_high", "aggregation", "dynamic_sampling")


def compares_group(advantage: str) -> bool:
    """Whether the estimator `advantage` compares the samples of a prompt's group."""
    return registry.load("advantage", advantage).COMPARES_GROUP


# What the off-policy correction uses where the field is left unset (tis or mis only).
_OFFPOLICY_BAND = {
    "offpolicy_level": "token",
    "offpolicy_ratio_min": 0.0,
    "offpolicy_ratio_max": 2.0,
}


@dataclass(kw_only=True, slots=True)
class AlgorithmSection:
    advantage: Literal[registry.names("advantage")] = "grpo"
    """Advantage estimator (a module of algorithms/advantages/): group mean/std (grpo), group
    mean only (dr_grpo), leave-one-out (rloo)."""
    loss: Literal[registry.names("loss")] = "grpo"
    """Policy loss (a module of algorithms/losses/), and the defaults of the fields it leaves
    unset. grpo: PPO-clipped token
    ratio, clip 0.2/0.2, seq_mean_token_mean (DeepSeekMath). dapo: the same ratio with
    clip-higher 0.2/0.28, token_mean and dynamic sampling (DAPO). gspo: one ratio per sequence,
    clip 3e-4/4e-4, seq_mean_token_mean (GSPO)."""
    aggregation: (
        Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant"] | None
    ) = None
    """How per-token losses add up (veRL's loss_agg_mode): over every sampled token of the
    step (token_mean), per sequence as a token mean or a token sum then over sequences
    (seq_mean_token_mean, seq_mean_token_sum), or over sequences * max_tokens (constant, Dr.
    GRPO). Unset: algorithm.loss's."""
    filter_zero_variance_groups: bool = False
    """Drop groups whose samples all got the same reward (zero advantage) from the loss."""
    dynamic_sampling: bool | None = None
    """DAPO's dynamic sampling: drop groups whose rewards are all equal and generate more
    prompts until each rank has its share of training.prompts_per_step informative groups, for
    at most algorithm.max_generation_rounds rounds (a rank still short trains on fewer groups:
    the rest are masked out of the loss, and counted). Unset: true for loss = dapo."""
    max_generation_rounds: int | None = None
    """Most generation rounds per step with dynamic sampling (1: no extra rounds). Unset: 4
    with dynamic sampling, else 1."""
    clip_eps_low: float | None = None
    """Lower clip range of the importance ratio: 1 - clip_eps_low. Unset: algorithm.loss's."""
    clip_eps_high: float | None = None
    """Upper clip range of the importance ratio: 1 + clip_eps_high. Unset: algorithm.loss's."""
    clip_ratio_c: float = 0.0
    """Dual clip (Ye et al. 2020, veRL's clip_ratio_c): a token with a negative advantage loses
    at most clip_ratio_c * |A|, however large its ratio; 0 disables it, else > 1 (e.g. 3)."""
    kl_beta: float = 0.0
    """Coefficient of the KL penalty to the frozen reference model; 0 builds no reference."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator (Schulman's k1, k2, k3); docs/rl_loop.md says which gradient each gives."""
    kl_in_reward: bool = False
    """Apply the KL penalty in the reward instead of the loss (veRL's use_kl_in_reward): each
    sample's reward loses kl_beta * the sum over its tokens of the estimator on the generator's
    logprobs, before advantages. false: kl_beta * the estimator joins the loss per token."""
    offpolicy_correction: Literal["auto", "none", "tis", "mis"] = "auto"
    """Correct the loss for the generator's policy (behaviour) differing from the trainer's
    before the update (old): tis weights each token's loss by old / behaviour truncated to
    [offpolicy_ratio_min, offpolicy_ratio_max]; mis keeps the weight where it lies in that band
    and drops the token (or sequence) where it does not (IcePop). auto: tis when
    algorithm.max_offpolicy_steps >= 1, else none."""
    offpolicy_level: Literal["token", "sequence"] | None = None
    """Ratio of each token, or of each sequence (the product over its tokens). Unset: token."""
    offpolicy_ratio_min: float | None = None
    """Lower bound of the off-policy ratio band (tis truncates to it, mis masks below it).
    Unset: 0 (IcePop uses 0.5)."""
    offpolicy_ratio_max: float | None = None
    """Upper bound of the off-policy ratio band (tis truncates to it, mis masks above it).
    Unset: 2 (IcePop uses 5)."""
    max_offpolicy_steps: int = 0
    """Disaggregated placement: generators may sample with weights up to this many optimizer
    steps old (policy age <= k), generating steps s+1..s+k while the trainer trains step s;
    0 is the synchronous loop. algorithm.offpolicy_correction corrects the loss for it."""
    overlong: Literal["keep", "zero_reward", "mask", "soft_penalty"] = "keep"
    """Completions cut by generator.sampling.max_tokens (finish_reason "length"): keep them
    as scored; give them reward 0; mask them out of the loss (DAPO's overlong filtering; they
    still count in their group's advantages); or soft_penalty: DAPO's overlong reward shaping,
    every sample of length L > max_tokens - overlong_buffer loses
    (L - (max_tokens - overlong_buffer)) / overlong_buffer, up to 1 at max_tokens."""
    overlong_buffer: int | None = None
    """The soft_penalty's buffer in tokens (DAPO's L_cache). Unset: max_tokens // 4."""
    router_replay: bool = False
    """Mixture-of-experts models: the trainer routes each token to the experts the generator
    routed it to (router replay, R3) instead of its own top-k, wherever the generator ran the
    token; the gate weights are still the trainer's, so the router learns. Removes
    `moe/routing_mismatch` and the logprob difference it causes (docs/moe.md)."""

    def resolve(self, max_tokens: int = 16) -> None:
        """Fill the fields left unset: algorithm.loss's preset, then the defaults that depend
        on other fields (`max_tokens`: the most tokens a sample can sample, for the overlong
        buffer). Idempotent: a resolved section stays as it is."""
        if self.overlong == "soft_penalty" and self.overlong_buffer is None:
            self.overlong_buffer = max(1, max_tokens // 4)
        for name, value in registry.load("loss", self.loss).PRESET.items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        if self.max_generation_rounds is None:
            self.max_generation_rounds = 4 if self.dynamic_sampling else 1
        if self.offpolicy_correction == "auto":
            self.offpolicy_correction = "tis" if self.max_offpolicy_steps >= 1 else "none"
        if self.offpolicy_correction != "none":
            for name, default in _OFFPOLICY_BAND.items():
                if getattr(self, name) is None:
                    setattr(self, name, default)

    def validate(self, max_tokens: int = 16) -> None:
        """Check the values of a resolved section (`max_tokens`: as for resolve); changes
        nothing."""
        filled = (*PRESET_FIELDS, "max_generation_rounds")
        if self.offpolicy_correction == "auto" or any(getattr(self, n) is None for n in filled):
            raise ValueError("AlgorithmSection.validate() needs resolve() first")
        require(
            self.overlong_buffer is None or self.overlong == "soft_penalty",
            f"algorithm.overlong_buffer = {self.overlong_buffer} has no effect with overlong = "
            f"{self.overlong!r}: set algorithm.overlong = 'soft_penalty', or unset it",
        )
        require(
            self.overlong_buffer is None or 1 <= self.overlong_buffer <= max_tokens,
            f"algorithm.overlong_buffer = {self.overlong_buffer}: must be in 1.."
            f"generator.sampling.max_tokens = {max_tokens}",
        )
        for name in ("clip_eps_low", "clip_eps_high", "kl_beta"):
            value = getattr(self, name)
            require(value >= 0, f"algorithm.{name} = {value}: must be >= 0")
        require(
            self.clip_eps_low < 1,
            f"algorithm.clip_eps_low = {self.clip_eps_low}: must be < 1 (ratios clip at 1 - it)",
        )
        require(
            self.clip_ratio_c == 0 or self.clip_ratio_c > 1 + self.clip_eps_high,
            f"algorithm.clip_ratio_c = {self.clip_ratio_c}: the dual clip must be above the "
            f"upper clip 1 + clip_eps_high = {1 + self.clip_eps_high}, e.g. 3; or 0 to disable",
        )
        require(
            self.max_generation_rounds >= 1,
            f"algorithm.max_generation_rounds = {self.max_generation_rounds}: must be >= 1",
        )
        require(
            self.max_generation_rounds == 1 or self.dynamic_sampling,
            f"algorithm.max_generation_rounds = {self.max_generation_rounds} has no effect "
            "without dynamic sampling: set algorithm.dynamic_sampling = true, or unset it",
        )
        require(
            not self.kl_in_reward or self.kl_beta > 0,
            "algorithm.kl_in_reward = true with kl_beta = 0 has no effect: set "
            "algorithm.kl_beta > 0 (e.g. 0.001), or kl_in_reward = false",
        )
        for name in _OFFPOLICY_BAND:
            require(
                getattr(self, name) is None or self.offpolicy_correction != "none",
                f"algorithm.{name} = {getattr(self, name)!r} has no effect with "
                "offpolicy_correction = 'none': set algorithm.offpolicy_correction to 'tis' "
                "or 'mis', or unset it",
            )
        require(
            self.offpolicy_correction == "none"
            or self.offpolicy_ratio_min <= 1 <= self.offpolicy_ratio_max,
            f"algorithm.offpolicy_ratio_min = {self.offpolicy_ratio_min} and "
            f"offpolicy_ratio_max = {self.offpolicy_ratio_max}: the band must contain 1 "
            "(an on-policy token's ratio), e.g. 0.5 and 2",
        )
