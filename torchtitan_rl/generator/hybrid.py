"""Qwen3.5's Gated DeltaNet layers inside vLLM: each keeps its recurrent state in vLLM's
per-request state cache, as vLLM's own hybrid models do, and runs gated_delta.py's routines
on it as one opaque op.

    .venv/bin/python -m pytest tests/integration/test_generator.py -k qwen3_5

vLLM schedules a hybrid model (`TorchTitanHybridForCausalLM`: `IsHybrid`) with two kinds of
cache: paged KV blocks for the full-attention layers (PagedAttention) and, per Gated DeltaNet
layer, one state slot per running request (`GatedDeltaState`, a `MambaBase` layer): the last
W - 1 inputs of its convolution and its recurrent state S (H x K x V; vLLM's layout is
H x V x K, which the op reads transposed). `gated_delta_paged` runs a forward's flat batch:
the prefills from zeros (a request's first step; prefixes are not cached: the engine turns
prefix caching off for hybrid models) with the chunked form, those of equal length together,
the decodes together, one recurrent step, each request's state read from and written back to
its slot.

vLLM's own CPU kernels for these layers take bf16 only and head dims of 64 or 128; this op
runs the trainer's routines in any dtype. In batch-invariant mode the prefill runs the
recurrent form too, as the trainer then does (models/qwen3_5.py), so both sides compute every
token's state by the same steps. The recurrent state stays fp32 between steps (the engine
sets `mamba_ssm_cache_dtype`), as the trainer keeps it within a sequence.
"""

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
    """vLLM's state cache of one Gated DeltaNet layer (no parameters): vLLM sizes it from
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
    ):
        super().__init__()
        config = get_current_vllm_config()
        self.model_config, self.cache_config = config.model_config, config.cache_config
        self.shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(
            1, key_heads, value_heads, key_dim, value_dim, width
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
    g_TH: torch.Tensor,
    beta_TH: torch.Tensor,
    conv_weight: torch.Tensor,
    layer_name: str,
    key_heads: int,
    key_dim: int,
    value_dim: int,
    invariant: bool,
) -> torch.Tensor:
    """The Gated DeltaNet outputs [T, H, V] of vLLM's flat batch of T tokens: the convolution
    over each request's tokens after the inputs its slot holds, then the rule from its slot's
    state; both written back. qkv_TC: the projected q|k|v channels (`key_heads` q and k heads
    of `key_dim`, repeated to the H value heads of `value_dim`); g, beta: per value head."""
    T, H = g_TH.shape
    out_THV = qkv_TC.new_zeros(T, H, value_dim)
    metadata, layer = _state_context(layer_name)
    if metadata is None:  # a dummy run: no request holds a slot
        return out_THV
    conv_states, ssm_states = layer.kv_cache
    starts = metadata.non_spec_query_start_loc.tolist()
    slots = metadata.non_spec_state_indices_tensor[: len(starts) - 1].long()
    has_state = metadata.has_initial_state
    decodes = metadata.num_decodes  # first in the batch, one token each
    rule = gated_delta.recurrent if invariant else gated_delta.chunked  # for prefills

    def conv_state(rows):  # [B, C, W - 1]
        return conv_states[rows] if is_conv_state_dim_first() else conv_states[rows].transpose(1, 2)

    def store(rows, conv_BCW, ssm_BHKV):
        conv_states[rows] = conv_BCW if is_conv_state_dim_first() else conv_BCW.transpose(1, 2)
        ssm_states[rows] = ssm_BHKV.transpose(-1, -2).to(ssm_states.dtype)

    def run(tokens_BL, rows, fresh, form):
        """Requests `rows`, of equal length, whose tokens are at `tokens_BL`, together."""
        x_BLC = qkv_TC[tokens_BL]
        state = None if fresh else conv_state(rows)
        mixed, conv_after = gated_delta.causal_conv(x_BLC, conv_weight, state)
        state = None if fresh else ssm_states[rows].transpose(-1, -2)
        q, k, v = gated_delta.heads(mixed, key_heads, key_dim, value_dim)
        out, state = form(q, k, v, g_TH[tokens_BL], beta_TH[tokens_BL], state)
        out_THV[tokens_BL.reshape(-1)] = out.reshape(-1, H, value_dim)
        store(rows, conv_after, state)

    if decodes:
        tokens = torch.arange(decodes, device=qkv_TC.device)[:, None]
        run(tokens, slots[:decodes], False, gated_delta.recurrent)
    # Prefills of equal length together: a prompt's n samples (each its own request, as a
    # hybrid engine caches no prefix) are one call, not n.
    groups: dict[tuple[int, bool], list[int]] = {}
    for i in range(decodes, len(starts) - 1):
        fresh = has_state is None or not bool(has_state[i])
        groups.setdefault((starts[i + 1] - starts[i], fresh), []).append(i)
    for (length, fresh), requests in groups.items():
        first = torch.tensor([starts[i] for i in requests], device=qkv_TC.device)
        tokens = first[:, None] + torch.arange(length, device=qkv_TC.device)
        run(tokens, slots[requests], fresh, rule)
    return out_THV


@gated_delta_paged.register_fake
def _(qkv_TC, g_TH, beta_TH, conv_weight, layer_name, key_heads, key_dim, value_dim, invariant):
    return qkv_TC.new_empty(g_TH.shape[0], g_TH.shape[1], value_dim)


def _state_context(layer_name: str):
    """(this forward's GDN metadata for the layer or None in a dummy run, the layer)."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    from torchtitan_rl.generator.attention import metadata_of

    if not is_forward_context_available():
        return None, None
    context = get_forward_context()
    return metadata_of(context.attn_metadata, layer_name), context.no_compile_layers[layer_name]
