"""The torchtitan model as a vLLM model: torchtitan layers, vLLM paged attention.

    .venv/bin/python -m pytest tests/*/test_generator.py

vLLM hands the model a flat batch of T tokens (prefills and decodes of many sequences mixed)
with their positions. The wrapper runs the torchtitan model on it as one 1 x T sequence and
swaps each layer's inner attention for vLLM's `Attention`, which reads and writes the paged KV
cache and knows where each sequence starts. Everything else (embeddings, QK-norm, RoPE at the
given positions, MLPs, the tied lm_head) is the trainer's own code, with plain weight tensors
that weight sync can overwrite in place. Shapes: T flat tokens, N heads, H head dim, D model dim.

Unless `generator.enforce_eager`, vLLM compiles the decoder (`Decoder`: embeddings, layers,
norm) as it compiles its own models: traced once at warm-up with the token dimension dynamic
and every guard dropped (on CPU, inductor; on CUDA, vLLM's piecewise backend and graphs). So
the decoder's forward is tensor code only: attention is vLLM's op or `paged_attend`, the MoE
routers write their expert ids into preallocated buffers in place, and what is done on the
host (filing those ids under their requests) runs after it, in `TorchTitanForCausalLM.forward`.
"""

import math
import re
from collections.abc import Iterable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateCopyFuncCalculator,
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
)
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid

from torchtitan_rl import batch_invariant
from torchtitan_rl.batch_invariant import make_linears_invariant
from torchtitan_rl.generator import tensor_parallel
from torchtitan_rl.generator.attention import PagedAttention
from torchtitan_rl.generator.packed import (
    PackedExperts,
    PackedFeedForward,
    PackedLinear,
    PackedStack,
    note_plain_experts,
    onednn_available,
)
from torchtitan_rl.generator.routing import RoutingLog
from torchtitan_rl.models import attention_shape, model_spec, weights
from torchtitan_rl.models.moe import local_shard, routers
from torchtitan_rl.trainer.model import hf_shapes, is_unread_key, mtp_layers, reads_vision

TP_BATCH_MULTIPLE = 64
"""A tensor-parallel generator pads each forward's tokens to a multiple of this (see forward)."""


def _compiles(vllm_config: VllmConfig) -> bool:
    """Whether vLLM may compile the decoder (unless enforce_eager): on one rank, or tensor
    parallel on local shards. A vocabulary the ranks do not split evenly runs DTensors, eager
    (the engine says so, and refuses enforce_eager = false for it)."""
    tp = vllm_config.parallel_config.tensor_parallel_size
    hf_config = vllm_config.model_config.hf_config
    spec = model_spec(hf_config.torchtitan_model, hf_config.torchtitan_flavor)
    return tensor_parallel.supported(spec, tp)


@support_torch_compile(
    dynamic_arg_dims={"input_ids": 0, "positions": 0, "inputs_embeds": 0}, enable_if=_compiles
)
class Decoder(nn.Module):
    """The torchtitan model's embeddings, decoder layers and final norm over vLLM's flat batch
    of T tokens: the module vLLM compiles (`support_torch_compile`, the token dimension
    dynamic). Tensor code only: see the module docstring."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", model: nn.Module):
        super().__init__()
        self.model = model

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None,
    ) -> torch.Tensor:
        """Hidden states [T, D] (a DTensor on the DTensor tensor-parallel path)."""
        if inputs_embeds is not None:  # None or not for the engine's lifetime
            h_1TD = inputs_embeds[None]
        else:
            h_1TD = self.model.tok_embeddings(input_ids[None])
        positions_1T = positions[None]
        for layer in self.model.layers.values():
            h_1TD = layer(h_1TD, None, positions_1T)
        return self.model.norm(h_1TD)[0]


class TorchTitanForCausalLM(nn.Module):
    """vLLM model interface around a torchtitan decoder named by the HF config.

    The engine passes `hf_overrides={"architectures": ["TorchTitanForCausalLM"],
    "torchtitan_model": name, "torchtitan_flavor": flavor, "torchtitan_packed_gemm": bool}`;
    vLLM sizes its KV cache from the HF-shaped config.json, which must describe the same shapes
    as the flavor.
    """

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        hf_config = self.hf_config = vllm_config.model_config.hf_config
        self.spec = model_spec(hf_config.torchtitan_model, hf_config.torchtitan_flavor)
        self.tp = vllm_config.parallel_config.tensor_parallel_size
        self.local_shards = self.tp > 1 and tensor_parallel.supported(self.spec, self.tp)
        """Tensor parallel on plain local shards (generator/tensor_parallel.py) once loaded;
        else, under TP, DTensors."""
        self.layouts: dict = {}
        """With local shards, each sharded weight's DTensor layout, by FQN."""
        invariant = getattr(hf_config, "torchtitan_batch_invariant", False)
        if self.tp > 1:
            ep = self.tp if getattr(hf_config, "torchtitan_expert_parallel", False) else 1
            self.dims = _tp_layout(self.spec, self.tp, ep)
        elif invariant and batch_invariant.slices() > 1:
            # One replica in a run whose trainer is tensor parallel: the row-parallel linears
            # reduce in the run's canonical slices (`make_linears_invariant` finds them in the
            # sharding plan, filled in without a mesh: nothing is sharded).
            from torchtitan.config.configs import ParallelismConfig

            from torchtitan_rl.trainer.parallel import fill_sharding_plan

            fill_sharding_plan(self.spec, ParallelismConfig(enable_sequence_parallel=False))
        model = self.spec.model.build()
        vllm_kernels = not invariant and getattr(hf_config, "torchtitan_packed_gemm", True)
        """vLLM's own CPU kernels where they apply (packed GEMMs, fused MoE, Gated DeltaNet):
        `generator.cpu_packed_gemm`, never in batch-invariant mode."""
        layer_configs = self.spec.model.layers
        for (index, layer), config in zip(model.layers.items(), layer_configs, strict=True):
            if getattr(config, "delta_net", None) is not None:  # Qwen3.5's linear attention
                layer.attn.paged = _state_layer(
                    config.delta_net,
                    f"{prefix}layers.{index}.attn.paged",
                    vllm_kernels,
                    vllm_config.model_config.dtype,
                    self.tp,
                )
                continue
            attention = attention_of(layer)
            shape = attention_shape(attention, self.spec.model.dim)
            attention.inner_attention = PagedAttention(
                n_heads=shape.heads // self.tp,
                n_kv_heads=shape.kv_heads // self.tp,
                head_dim=shape.head_dim,
                v_head_dim=shape.v_head_dim,
                # gpt-oss and DeepSeek-V3 fold YaRN's attention factor into their softmax scale
                # (their RoPE, which this wrapper runs, does not apply it).
                scale=getattr(attention, "softmax_scale", shape.head_dim**-0.5),
                prefix=f"{prefix}layers.{index}.attention.inner_attention",
                cache_config=vllm_config.cache_config,
                window=getattr(config.attention, "sliding_window_size", None),
                sinks=_local_heads(getattr(attention, "sinks", None), self.tp),
                batch_invariant=invariant,
            )
        if self.tp > 1:
            # The spec's own TP/EP plan (its modules' sharding configs, filled in as the
            # trainer's are), without data parallelism: the core of every family's
            # parallelize_fn (not all of them can skip FSDP: DeepSeek-V3's cannot).
            model.parallelize(self.dims)
            # vLLM's attention reads the sinks of the rank's heads: the local shard of each
            # layer's sinks parameter, so that weight sync's in-place writes reach it.
            for layer in model.layers.values():
                attention = attention_of(layer)
                if getattr(attention, "sinks", None) is not None:
                    sinks = local_shard(attention.sinks).detach()
                    attention.inner_attention.attn.impl.sinks = sinks
        with torch.no_grad():
            model.init_states()  # computes the RoPE cache; weights come from load_weights
        self.invariant = invariant
        if invariant and not self.local_shards:
            # The trainer's kernels on the generator side; no packed copies. (On local shards
            # once they are: `localize` drops the modules' forwards.)
            make_linears_invariant(model)
        self.packed = (
            vllm_kernels
            and (self.tp == 1 or self.local_shards)  # DTensor shards run plain GEMMs
            and onednn_available(vllm_config.model_config.dtype)
        )
        """GEMMs on oneDNN-packed copies of the weights (on local shards: once loaded)."""
        if self.packed and self.tp == 1:
            _pack(model)
        self.model = model
        self.decoder = Decoder(vllm_config=vllm_config, prefix=prefix, model=model)
        """What vLLM compiles; `model`'s parameters keep their names (registered first)."""
        moe_routers = routers(model)
        self.routing = None
        """The experts each request's tokens went to (MoE models; generator/routing.py)."""
        if moe_routers:
            pad = math.lcm(self.tp, TP_BATCH_MULTIPLE) if self.tp > 1 else 0
            rows = vllm_config.scheduler_config.max_num_batched_tokens + pad
            self.routing = RoutingLog(moe_routers, rows)

    def _replicated(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Under TP, each whole checkpoint tensor as a Replicate DTensor where its parameter is
        a DTensor: torchtitan's fused-QKV load hook then concatenates DTensors, and `copy_`
        keeps each rank's shard of the result. Buffers too (DeepSeek-V3's checkpoints hold
        the routers' correction bias, a DTensor buffer under TP)."""
        params = dict(self.model.named_parameters()) | dict(self.model.named_buffers())
        out = {}
        for name, tensor in state.items():
            fused = re.sub(r"\.w[qkv]\.", ".wqkv.", name)
            target = params.get(name, params.get(fused))
            if isinstance(target, DTensor):
                mesh = target.device_mesh
                tensor = DTensor.from_local(tensor, mesh, [Replicate()] * mesh.ndim)
            out[name] = tensor
        return out

    def repack(self) -> None:
        """Refresh derived copies of the weights; call after every in-place weight update."""
        for module in self.model.modules():
            if isinstance(module, (PackedLinear, PackedExperts, PackedFeedForward, PackedStack)):
                module.repack()

    def drop_packed(self) -> None:
        """Free the packed copies of the weights (until the next `repack`)."""
        for module in self.model.modules():
            if isinstance(module, (PackedLinear, PackedFeedForward, PackedStack)):
                module._handler = None
            elif isinstance(module, PackedExperts):
                module._w13_EGD = module._w2_EDF = None

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.tok_embeddings(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors=None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, D] of the flat token batch (positions always given)."""
        if positions.ndim == 2:
            # MRoPE's [3, T] (Qwen3.5's config.json names its sections): text's three rows
            # (temporal, height, width) are the same positions.
            positions = positions[0]
        T = positions.shape[0]
        if self.tp > 1 and not self.local_shards:
            input_ids, positions, inputs_embeds = self._padded(input_ids, positions, inputs_embeds)
        hidden_TD = _whole(self.decoder(input_ids, positions, inputs_embeds))[:T]
        if self.routing is not None:  # on the host, after the compiled decoder
            self.routing.commit(positions[:T], T)
        return hidden_TD

    def _padded(self, input_ids, positions, inputs_embeds):
        """A tensor-parallel generator's batch (eager), padded: the spec's plan splits the
        tokens over the ranks between layers (sequence parallel), and torchtitan's
        expert-parallel dispatch assumes equal splits (measured: 441 tokens over 2 ranks failed
        in the MoE's residual add): pad to a multiple of the ranks. And to a multiple of
        TP_BATCH_MULTIPLE tokens: DTensor caches its sharding decisions per shape, and every
        decode step's batch size would otherwise be a new shape (measured, tiny MoE at EP = 2,
        8 prompts x 4 samples x 32 tokens: 4.32 s unpadded, 2.29 s at multiples of 16, 1.63 s
        at 64). vLLM's attention computes only the real rows (`PagedAttention.tokens`); the
        padding's hidden states are dropped at the end."""
        T = positions.shape[0]
        pad = -T % math.lcm(self.tp, TP_BATCH_MULTIPLE)
        for layer in self.model.layers.values():
            attention = attention_of(layer)
            if isinstance(getattr(attention, "inner_attention", None), PagedAttention):
                attention.inner_attention.tokens = T  # not a Gated DeltaNet layer's
        if input_ids is not None:
            input_ids = nn.functional.pad(input_ids, (0, pad))
        if inputs_embeds is not None:
            inputs_embeds = nn.functional.pad(inputs_embeds, (0, 0, 0, pad))
        return input_ids, nn.functional.pad(positions, (0, pad)), inputs_embeds

    def compute_logits(self, hidden_states_TD: torch.Tensor) -> torch.Tensor:
        """Every TP rank's sampler reads the whole vocabulary."""
        logits_TV = self.model.lm_head(hidden_states_TD)
        if self.local_shards:
            return tensor_parallel.gather_vocabulary(logits_TV)
        return _whole(logits_TV)

    def weights(self) -> dict[str, torch.Tensor]:
        """What weight sync writes (`models.weights`), a sharded weight as its DTensor."""
        return tensor_parallel.as_dtensors(weights(self.model), self.layouts)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors through the spec's adapter; returns our parameter names.

        Streamed: vLLM's iterator reads one tensor at a time, and each decoder layer is loaded
        as soon as all of its tensors have arrived, so at most one layer's worth of checkpoint
        tensors is held besides the model (not a second copy of the whole model).
        """
        adapter = self.spec.state_dict_adapter(self.spec.model, None)
        expected = set(hf_shapes(self.spec))
        mtp, vision = mtp_layers(expected, self.hf_config.to_dict()), reads_vision(expected)
        layer_names: dict[str, set[str]] = {}
        for name in expected:
            layer_names.setdefault(_layer_of(name), set()).add(name)
        pending: dict[str, dict[str, torch.Tensor]] = {}
        arrived, unexpected = set(), []

        # from_hf insists on the (tied) embedding in every call: a layer's call gets this
        # placeholder instead, and what comes of it is dropped.
        placeholder = torch.empty(0)

        def load(group: dict[str, torch.Tensor]) -> None:
            state = adapter.from_hf({"lm_head.weight": placeholder, **group})
            state = {k: v for k, v in state.items() if v is not placeholder}
            # torchtitan's load hooks fuse wq/wk/wv into wqkv: a layer loads in one call.
            if self.tp > 1:
                state = self._replicated(state)
            with torch.no_grad():
                result = self.model.load_state_dict(state, strict=False)
            unexpected.extend(result.unexpected_keys)

        for name, tensor in weights:
            if is_unread_key(name, mtp, vision):
                continue  # a multi-token-prediction layer, a text-only flavor's vision tower
            arrived.add(name)
            key = _layer_of(name)
            pending.setdefault(key, {})[name] = tensor
            if key != "rest" and layer_names.get(key, {name}) <= set(pending[key]):
                load(pending.pop(key))
        for group in pending.values():  # the embedding, final norm and lm_head; unknown names
            load(group)
        missing = sorted(expected - arrived)
        if missing or unexpected:
            raise ValueError(
                f"checkpoint does not fit {self.spec.name}/{self.spec.flavor}: "
                f"missing {missing[:3]}, unexpected {unexpected[:3]}"
            )
        self.repack()
        names = {name for name, _ in self.named_parameters()}
        if self.local_shards:
            self.layouts, reduced = tensor_parallel.localize(self.model)
            if self.invariant:
                make_linears_invariant(self.model)
            if self.packed:
                _pack(self.model)
                self.repack()
            tensor_parallel.add_all_reduces(self.model, reduced)
        return names


class TorchTitanHybridForCausalLM(TorchTitanForCausalLM, IsHybrid, HasInnerState):
    """`TorchTitanForCausalLM` for a model with Gated DeltaNet layers (Qwen3.5): vLLM keeps a
    state slot per request for each of them (generator/hybrid.py) beside the paged KV cache of
    the full-attention layers. Its own architecture name: vLLM would take any model of a class
    declaring `IsHybrid` for hybrid when its config.json lists no `layer_types`. The state's
    shapes and dtypes come from the checkpoint's config.json (`linear_*`), as for vLLM's own
    Qwen3.5."""

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig):
        config = vllm_config.model_config.hf_text_config
        return MambaStateShapeCalculator.gated_delta_net_state_shape(
            vllm_config.parallel_config.tensor_parallel_size,
            config.linear_num_key_heads,
            config.linear_num_value_heads,
            config.linear_key_head_dim,
            config.linear_value_head_dim,
            config.linear_conv_kernel_dim,
        )

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig):
        return MambaStateDtypeCalculator.gated_delta_net_state_dtype(
            vllm_config.model_config.dtype,
            vllm_config.cache_config.mamba_cache_dtype,
            vllm_config.cache_config.mamba_ssm_cache_dtype,
        )

    @classmethod
    def get_mamba_state_copy_func(cls):
        return MambaStateCopyFuncCalculator.gated_delta_net_state_copy_func()


def attention_of(layer: nn.Module) -> nn.Module:
    """A decoder layer's attention module (Qwen3.5's is named `attn`)."""
    return layer.attention if hasattr(layer, "attention") else layer.attn


def _state_layer(config, prefix: str, vllm_kernels: bool, dtype: torch.dtype, tp: int) -> nn.Module:
    """The vLLM state layer of a Gated DeltaNet layer of `config` (generator/hybrid.py), its
    slots holding a rank's heads of `tp`, on vLLM's kernels where `vllm_kernels` and they
    take the layer."""
    from torchtitan_rl.generator.hybrid import GatedDeltaState, uses_vllm_kernels

    return GatedDeltaState(
        key_heads=config.in_proj_q.out_features // config.key_head_dim,
        value_heads=config.in_proj_v.out_features // config.value_head_dim,
        key_dim=config.key_head_dim,
        value_dim=config.value_head_dim,
        width=config.conv_kernel_size,
        tp=tp,
        prefix=prefix,
        vllm_kernels=vllm_kernels
        and uses_vllm_kernels(dtype, config.key_head_dim, config.value_head_dim),
    )


def _pack(model: nn.Module) -> None:
    """Run `model`'s GEMMs on oneDNN-packed copies (packed.py), in place: its feed-forwards'
    w1 and w3 stacked, a Gated DeltaNet's input projections stacked, every other linear
    alone, MoE experts on the fused kernel."""
    stacked = set()
    for name, module in list(model.named_modules()):
        parent, _, child = name.rpartition(".")
        if PackedFeedForward.fits(module):
            setattr(model.get_submodule(parent), child, PackedFeedForward(module))
        elif hasattr(module, "stacked") and PackedStack.fits(module):  # Qwen3.5's DeltaNet
            module.stacked = PackedStack([getattr(module, n) for n in module.PROJECTIONS])
            stacked.update(module.stacked.linears)
    for name, module in list(model.named_modules()):
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent)
        if isinstance(module, nn.Linear) and not isinstance(owner, PackedFeedForward):
            if module not in stacked:
                setattr(owner, child, PackedLinear(module))
        elif child == "routed_experts":
            why = PackedExperts.why_not(module.inner_experts)
            if why:
                note_plain_experts(why)
            else:
                setattr(owner, child, PackedExperts(module))


def _local_heads(sinks: torch.Tensor | None, tp: int) -> torch.Tensor | None:
    """What vLLM's attention is built with for a layer's sinks: the parameter itself, or under
    TP a stand-in of the rank's heads (the parameter's shard replaces it once the TP plan has
    sharded it)."""
    if sinks is None or tp == 1:
        return sinks
    return sinks.new_zeros(sinks.shape[0] // tp)


def _tp_layout(spec, tp: int, ep: int):
    """torchtitan's `ParallelDims` of a generator sharded `tp` ways (its TP groups are
    consecutive ranks, as vLLM's), its experts `ep` ways (1, or tp: whole experts over the TP
    ranks), with the spec's sharding plan filled in as the trainer's is."""
    import torch.distributed as dist

    from torchtitan_rl.config import ParallelismSection
    from torchtitan_rl.trainer.parallel import fill_sharding_plan, layout

    world = dist.get_world_size()
    dims, parallelism = layout(ParallelismSection(dp_shard=world // tp, tp=tp, ep=ep), world)
    fill_sharding_plan(spec, parallelism)
    return dims


def _whole(x: torch.Tensor) -> torch.Tensor:
    """A TP DTensor gathered to the plain whole tensor vLLM expects (a plain tensor as is)."""
    return x.full_tensor() if isinstance(x, DTensor) else x


def _layer_of(hf_name: str) -> str:
    """The group an HF tensor loads with: its decoder layer ("model.layers.3",
    "model.language_model.layers.3"), or "rest" (embedding, final norm, lm_head), loaded
    last."""
    parts = hf_name.split(".")
    if "layers" not in parts[:-2]:
        return "rest"
    at = parts.index("layers")
    return ".".join(parts[: at + 2])
