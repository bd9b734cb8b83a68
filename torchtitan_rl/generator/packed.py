"""oneDNN-packed copies of the generator's weights: vLLM's CPU GEMM and fused-MoE kernels.

    .venv/bin/python -m pytest tests/unit/test_generator.py

vLLM's native CPU models run their linear layers on oneDNN-prepacked weights and their MoE
layers on a fused kernel over prepacked expert weights. These modules do the same for the
torchtitan model while keeping the plain parameters weight sync writes into; `repack()`
refreshes the packed copies after every update. Both kernels are registered torch ops, so
the compiled generator (vllm_model.Decoder) traces through them.
"""

import functools

import torch
import torch.nn as nn

from torchtitan_rl import console
from torchtitan_rl.generator.tensor_parallel import RankExperts
from torchtitan_rl.models.moe import Experts, OssExperts


def onednn_available(dtype: torch.dtype) -> bool:
    from vllm import _custom_ops as ops
    from vllm.platforms import current_platform

    if not (current_platform.is_cpu() and ops._supports_onednn):
        return False
    if dtype == torch.bfloat16 and "AVX512" not in torch.backends.cpu.get_cpu_capability():
        # Measured on an AVX2 CPU: oneDNN has no bf16 matmul there ("could not create a
        # primitive descriptor"); plain GEMMs run instead.
        console.warn(
            "warning: generator.cpu_packed_gemm: no oneDNN bf16 GEMM on this CPU "
            "(AVX2); the generator runs plain GEMMs"
        )
        return False
    return True


class PackedLinear(nn.Module):
    """A linear layer whose GEMM runs on a oneDNN-packed copy of its weight (vLLM's CPU GEMM).

    On CPU, vLLM's native models use oneDNN on prepacked weights, ~2.3x faster than F.linear
    here. The plain `weight` Parameter stays the one weight sync writes into (same object, same
    FQN, ties preserved); `repack()` refreshes the packed copy after every update.
    """

    def __init__(self, linear: nn.Linear):
        from torchtitan_rl.trainer.logprobs import soft_cap

        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.cap = soft_cap(linear)
        """The head's transform of its logits, kept (Muse Glimmer's soft cap)."""
        self.bias_shares = getattr(linear, "tp_degree", 1)
        """A row-parallel linear's ranks, each adding this share of the bias before the sum
        (torchtitan's `ScaledBiasRowwiseLinear`); 1 elsewhere."""
        self._bias_share = None
        """With bias shares, this rank's share of the bias (a copy, refreshed by `repack`)."""
        self._handler = None

    def repack(self) -> None:
        from vllm import _custom_ops as ops

        self._handler = ops.create_onednn_mm(self.weight.detach().t(), 32)
        if self.bias is not None and self.bias_shares > 1:
            self._bias_share = self.bias.detach() / self.bias_shares

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from vllm import _custom_ops as ops

        bias = self.bias if self._bias_share is None else self._bias_share
        y = ops.onednn_mm(self._handler, x.reshape(-1, x.shape[-1]), bias)
        y = y.view(*x.shape[:-1], y.shape[-1])
        return y if self.cap is None else self.cap(y)


class PackedExperts(nn.Module):
    """An MoE layer's routed experts on vLLM's CPU fused-MoE kernel (what its native MoE
    models run) over a packed copy of the expert weights: gate and up projections, the
    activation, down projection and the routing-weighted sum of each token's experts in one
    call. Qwen3's SwiGLU experts run its "silu"; gpt-oss's (biased, clamped SwiGLU over
    interleaved gate/up rows, as its `mlp1` holds them) its "swigluoai", with the biases.

    It takes the place of torchtitan's `RoutedExperts` (dispatch, grouped GEMMs, combine);
    `inner_experts` keeps the weights weight sync writes into, under the same FQNs, and
    `repack()` refreshes the packed copy after every update, as `PackedLinear`'s.

    On a tensor-parallel generator's local shards (tensor_parallel.py) its output is summed
    over the ranks: each expert's hidden slice (gpt-oss's output bias 1 / TP per rank), or
    with expert parallelism the rank's whole experts, `first` to `first + count`. The kernel
    takes ids of its own experts only: another rank's are given the rank's first expert with
    a routing weight of 0 (its rows computed, weighted 0).
    """

    ISA = "vec"  # vLLM's portable CPU kernel (its "amx" one needs AMX and bf16)

    def __init__(self, routed_experts: nn.Module):
        super().__init__()
        self.inner_experts = routed_experts.inner_experts
        dispatcher = routed_experts.token_dispatcher
        self.rank_experts = dispatcher if isinstance(dispatcher, RankExperts) else None
        """Expert parallel: the dispatcher that knows this rank's experts (None: all here)."""
        self._w13_EGD = self._w2_EDF = None

    @staticmethod
    def fits(inner_experts: nn.Module) -> bool:
        return not PackedExperts.why_not(inner_experts)

    @staticmethod
    def why_not(inner_experts: nn.Module) -> str:
        """Why the kernel cannot take these experts ('' where it can): its alignment, model
        and expert widths multiples of 32; for gpt-oss's, torchtitan's SwiGLU clamp (7.0),
        which the kernel has built in."""
        if isinstance(inner_experts, OssExperts) and inner_experts.swiglu_limit != 7.0:
            return f"gpt-oss's SwiGLU clamp is {inner_experts.swiglu_limit:g}, the kernel's 7"
        if not isinstance(inner_experts, (Experts, OssExperts)):
            return f"{type(inner_experts).__name__} is not one of its expert kinds"
        _, D, F = PackedExperts._weights(inner_experts)[1].shape  # w2, read without a copy
        if F % 32 or D % 32:
            return f"expert width {F} or model width {D} (a rank's) is not a multiple of 32"
        return ""

    @staticmethod
    def _weights(experts: nn.Module) -> tuple:
        """(the pieces of w13 [E, 2F, D] along dim 1, w2 [E, D, F], w13 bias, w2 bias, the
        kernel's activation): the parameters themselves, nothing copied."""
        if isinstance(experts, OssExperts):
            return (
                (experts.mlp1_weight_EGD,),
                experts.mlp2_weight_EDF,
                experts.mlp1_bias_EG,
                experts.mlp2_bias_ED,
                "swigluoai",
            )
        return (experts.w1_EFD, experts.w3_EFD), experts.w2_EDF, None, None, "silu"

    def repack(self) -> None:
        from vllm._custom_ops import cpu_prepack_moe_weight

        with torch.no_grad():
            w13_pieces, w2_EDF, b13_EG, b2_ED, self._activation = self._weights(self.inner_experts)
            w13_EGD = torch.cat(w13_pieces, dim=1)
            self._w13_EGD = cpu_prepack_moe_weight(w13_EGD.contiguous(), self.ISA)
            self._w2_EDF = cpu_prepack_moe_weight(w2_EDF.contiguous(), self.ISA)
            # The bias parameters themselves, read at each call (a tuple: not registered again
            # under this module's names, which weight sync would see); a share of the output
            # bias under TP, refreshed here after each update.
            shares = getattr(self.inner_experts, "tp_degree", 1)
            self._biases = (b13_EG, b2_ED if shares == 1 else b2_ED / shares)

    def forward(self, x_BLD, topk_scores_BLK, topk_expert_ids_BLK, num_tokens_per_expert_E):
        from vllm._custom_ops import cpu_fused_moe

        x_TD = x_BLD.reshape(-1, x_BLD.shape[-1]).contiguous()
        K = topk_scores_BLK.shape[-1]
        scores_TK = topk_scores_BLK.reshape(-1, K).float()
        ids_TK = topk_expert_ids_BLK.reshape(-1, K)
        if self.rank_experts is not None:
            local_TK, mine_TK = self.rank_experts.mine(ids_TK)
            scores_TK = torch.where(mine_TK, scores_TK, 0.0)
            ids_TK = torch.where(mine_TK, local_TK, 0)
        out_TD = torch.empty_like(x_TD)
        cpu_fused_moe(
            out_TD,
            x_TD,
            self._w13_EGD,
            self._w2_EDF,
            *self._biases,
            scores_TK.contiguous(),
            ids_TK.to(torch.int32).contiguous(),
            self._activation,
            self.ISA,
            False,  # weight each expert's output by its routing score
        )
        return out_TD.view_as(x_BLD)


class PackedFeedForward(nn.Module):
    """torchtitan's SwiGLU feed-forward, w2(silu(w1 x) * w3 x), with w1 and w3 in one oneDNN
    GEMM over a packed copy of both stacked, as vLLM's merged gate/up projection runs them (one
    call per layer instead of two); w2 a `PackedLinear`. `w1` and `w3` stay the modules whose
    weights weight sync writes (same FQNs), not run; `repack()` refreshes the stacked copy."""

    def __init__(self, feed_forward: nn.Module):
        super().__init__()
        self.w1, self.w3 = feed_forward.w1, feed_forward.w3
        self.w2 = PackedLinear(feed_forward.w2)
        self._handler = None

    @staticmethod
    def fits(module: nn.Module) -> bool:
        """torchtitan's plain FeedForward (not a gated subclass), without biases."""
        from torchtitan.models.common.feed_forward import FeedForward

        if type(module) is not FeedForward:
            return False
        return all(getattr(module, w).bias is None for w in ("w1", "w2", "w3"))

    def repack(self) -> None:
        from vllm import _custom_ops as ops

        with torch.no_grad():
            w13_GD = torch.cat([self.w1.weight, self.w3.weight])
            self._handler = ops.create_onednn_mm(w13_GD.t(), 32)  # packed: w13_GD is freed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from vllm import _custom_ops as ops

        h_TG = ops.onednn_mm(self._handler, x.reshape(-1, x.shape[-1]), None)
        gate_TF, up_TF = h_TG.chunk(2, dim=-1)
        out = self.w2(nn.functional.silu(gate_TF) * up_TF)
        return out.view(*x.shape[:-1], out.shape[-1])


class PackedStack(nn.Module):
    """Linear layers without biases that read the same input, in one oneDNN GEMM over a
    packed copy of their weights stacked, as vLLM's merged projections run them (Qwen3.5's
    Gated DeltaNet: six projections, one call); returns their outputs concatenated, in
    order. The layers stay their owner's modules (same FQNs), whose weights weight sync
    writes, not run; `repack()` refreshes the stacked copy."""

    def __init__(self, linears: list[nn.Linear]):
        super().__init__()
        self.linears = tuple(linears)  # a tuple: not submodules, so no second FQN
        self._handler = None

    @staticmethod
    def fits(module: nn.Module) -> bool:
        """A module naming its stackable linears (`PROJECTIONS`), none with a bias."""
        return all(getattr(module, name).bias is None for name in module.PROJECTIONS)

    def repack(self) -> None:
        from vllm import _custom_ops as ops

        with torch.no_grad():
            stacked_GD = torch.cat([linear.weight for linear in self.linears])
            self._handler = ops.create_onednn_mm(stacked_GD.t(), 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from vllm import _custom_ops as ops

        y = ops.onednn_mm(self._handler, x.reshape(-1, x.shape[-1]), None)
        return y.view(*x.shape[:-1], y.shape[-1])


@functools.cache
def note_plain_experts(why: str) -> None:
    console.warn(
        f"note: generator.cpu_packed_gemm: the MoE experts run plain grouped GEMMs, not vLLM's "
        f"fused-MoE kernel: {why}"
    )
