"""The torchtitan model as a vLLM model: torchtitan layers, vLLM paged attention.

    .venv/bin/python -m pytest tests/*/test_generator.py

vLLM hands the model a flat batch of T tokens (prefills and decodes of many sequences mixed)
with their positions. The wrapper runs the torchtitan model on it as one 1 x T sequence and
swaps each layer's inner attention for vLLM's `Attention`, which reads and writes the paged KV
cache and knows where each sequence starts. Everything else (embeddings, QK-norm, RoPE at the
given positions, MLPs, the tied lm_head) is the trainer's own code, with plain weight tensors
that weight sync can overwrite in place. Shapes: T flat tokens, N heads, H head dim, D model dim.
"""

import math
import re
from collections.abc import Iterable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate
from torchtitan.config.configs import CompileConfig, TrainingConfig
from vllm.config import VllmConfig
from vllm.model_executor.layers.attention import Attention

from torchtitan_rl import console
from torchtitan_rl.batch_invariant import attend, make_linears_invariant
from torchtitan_rl.generator.routing import RoutingLog
from torchtitan_rl.models import model_spec
from torchtitan_rl.models.moe import Experts, OssExperts, routers
from torchtitan_rl.trainer.model import hf_shapes


def _onednn_available(dtype: torch.dtype) -> bool:
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
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self._handler = None

    def repack(self) -> None:
        from vllm import _custom_ops as ops

        self._handler = ops.create_onednn_mm(self.weight.detach().t(), 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from vllm import _custom_ops as ops

        y = ops.onednn_mm(self._handler, x.reshape(-1, x.shape[-1]), self.bias)
        return y.view(*x.shape[:-1], y.shape[-1])


class PackedExperts(nn.Module):
    """An MoE layer's routed experts on vLLM's CPU fused-MoE kernel (what its native MoE
    models run) over a packed copy of the expert weights: gate and up projections, the
    activation, down projection and the routing-weighted sum of each token's experts in one
    call. Qwen3's SwiGLU experts run its "silu"; gpt-oss's (biased, clamped SwiGLU over
    interleaved gate/up rows, as its `mlp1` holds them) its "swigluoai", with the biases.

    It takes the place of torchtitan's `RoutedExperts` (dispatch, grouped GEMMs, combine);
    `inner_experts` keeps the weights weight sync writes into, under the same FQNs, and
    `repack()` refreshes the packed copy after every update, as `PackedLinear`'s.
    """

    ISA = "vec"  # vLLM's portable CPU kernel (its "amx" one needs AMX and bf16)

    def __init__(self, routed_experts: nn.Module):
        super().__init__()
        self.inner_experts = routed_experts.inner_experts
        self._w13_EGD = self._w2_EDF = None

    @staticmethod
    def fits(inner_experts: nn.Module) -> bool:
        """The kernel's alignment: model and expert widths multiples of 32; for gpt-oss's,
        torchtitan's SwiGLU clamp (7.0), which the kernel has built in."""
        if isinstance(inner_experts, OssExperts) and inner_experts.swiglu_limit != 7.0:
            return False
        if not isinstance(inner_experts, (Experts, OssExperts)):
            return False
        _, D, F = PackedExperts._weights(inner_experts)[1].shape  # w2, read without a copy
        return F % 32 == 0 and D % 32 == 0

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
            # under this module's names, which weight sync would see).
            self._biases = (b13_EG, b2_ED)

    def forward(self, x_BLD, topk_scores_BLK, topk_expert_ids_BLK, num_tokens_per_expert_E):
        from vllm._custom_ops import cpu_fused_moe

        x_TD = x_BLD.reshape(-1, x_BLD.shape[-1]).contiguous()
        K = topk_scores_BLK.shape[-1]
        out_TD = torch.empty_like(x_TD)
        cpu_fused_moe(
            out_TD,
            x_TD,
            self._w13_EGD,
            self._w2_EDF,
            *self._biases,
            topk_scores_BLK.reshape(-1, K).float().contiguous(),
            topk_expert_ids_BLK.reshape(-1, K).to(torch.int32).contiguous(),
            self._activation,
            self.ISA,
            False,  # weight each expert's output by its routing score
        )
        return out_TD.view_as(x_BLD)


class PagedAttention(nn.Module):
    """torchtitan inner attention backed by vLLM's paged `Attention` (causal, varlen), with
    gpt-oss's per-layer sliding `window` and attention `sinks` (the torchtitan layer's own
    parameter, so weight sync reaches it) passed to vLLM's kernel, which applies both.

    With `batch_invariant`, vLLM's Attention keeps the paged KV cache (its allocation, block
    tables, prefix caching) but the attention itself is `batch_invariant.ops.attention`, the
    trainer's routine: this step's keys/values are written to the cache first (samples of one
    prompt share its prefill blocks within the same step), then each sequence's keys/values are
    read back in position order and its queries attend over them.
    """

    def __init__(
        self,
        *,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        scale: float,
        prefix: str,
        cache_config,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
        batch_invariant: bool = False,
    ):
        super().__init__()
        self.batch_invariant = batch_invariant
        self.window = window
        self.tokens: int | None = None
        """The real rows of this forward's batch under TP (set by the wrapper, which pads)."""
        extra = {} if sinks is None else {"sinks": sinks}
        self.attn = Attention(
            n_heads,
            head_dim,
            scale,
            num_kv_heads=n_kv_heads,
            cache_config=cache_config,
            per_layer_sliding_window=window,
            prefix=prefix,  # vLLM binds each layer's KV cache by this unique name
            **extra,
        )

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, out_transform=None, **_) -> torch.Tensor:
        """`out_transform`: torchtitan's sink rescale, applied here in batch-invariant mode
        only (vLLM's kernel applies the sinks itself)."""
        if isinstance(q_BLNH, DTensor):  # TP: this rank's heads, which vLLM's attention holds
            # Only the batch's real rows (the wrapper pads it): vLLM writes each row's key and
            # value to the cache slot its slot mapping gives, and a padding row has none
            # (measured: written anyway, it corrupted a cached block; logprobs off by 6e-3).
            q, k, v = (x.to_local()[:, : self.tokens] for x in (q_BLNH, k_BLNH, v_BLNH))
            out_BLNH = self.forward(q, k, v, out_transform=out_transform)
            pad = q_BLNH.shape[1] - out_BLNH.shape[1]
            out_BLNH = nn.functional.pad(out_BLNH, (0, 0, 0, 0, 0, pad))
            return DTensor.from_local(out_BLNH, q_BLNH.device_mesh, q_BLNH.placements)
        B, L, N, H = q_BLNH.shape  # B == 1: vLLM's flat token batch
        if self.batch_invariant:
            return self._invariant_forward(q_BLNH[0], k_BLNH[0], v_BLNH[0], out_transform)
        out_LD = self.attn(q_BLNH.reshape(L, N * H), k_BLNH.reshape(L, -1), v_BLNH.reshape(L, -1))
        return out_LD.view(B, L, N, H)

    def _cache_rows(self) -> torch.Tensor:
        """The layer's KV cache as rows of H values. vLLM allocates it as [blocks, K heads,
        block size, 2H]; this mode owns the layout inside each block: (K head, k|v, slot)."""
        return self.attn.kv_cache.view(-1, self.attn.kv_cache.shape[-1] // 2)

    def _invariant_forward(self, q_LNH, k_LKH, v_LKH, out_transform) -> torch.Tensor:
        """[1, L, N, H] attention of the flat batch with the trainer's routine."""
        out_1LNH = torch.zeros_like(q_LNH)[None]
        metadata = _attention_metadata(self.attn.layer_name)
        if metadata is None:  # a dummy run: nothing to attend to
            return out_1LNH
        blocks, kv_heads, block_size, _ = self.attn.kv_cache.shape
        H = q_LNH.shape[-1]
        rows = self._cache_rows()
        heads = torch.arange(kv_heads)

        # 1. Write: row of (slot s, head h, k|v) = ((block * K + h) * 2 + k|v) * bs + offset.
        slots = metadata.slot_mapping[: q_LNH.shape[0]]
        valid = slots >= 0
        block, offset = slots[valid] // block_size, slots[valid] % block_size
        key_rows = ((block[:, None] * kv_heads + heads) * 2) * block_size + offset[:, None]
        for rows_of, x_LKH in ((key_rows, k_LKH), (key_rows + block_size, v_LKH)):
            rows.index_copy_(0, rows_of.reshape(-1), x_LKH[valid].to(rows.dtype).reshape(-1, H))

        # 2. Read each sequence's keys/values back in position order, attend.
        starts = metadata.query_start_loc.tolist()
        lengths = metadata.seq_lens.tolist()
        cache = self.attn.kv_cache.view(blocks, kv_heads, 2, block_size, H)
        for i, length in enumerate(lengths):
            first, last = starts[i], starts[i + 1]
            if last <= first:
                continue
            used = metadata.block_table[i, : -(-length // block_size)].long()
            kv_2SKH = cache[used].permute(2, 0, 3, 1, 4).reshape(2, -1, kv_heads, H)[:, :length]
            first_position = length - (last - first)
            if self.window is not None:
                # vLLM frees the blocks that fell out of every query's window: their slots may
                # hold other data now. The trainer masks these keys; zero them so they add
                # exact zeros here as there.
                kv_2SKH[:, : max(0, first_position - self.window + 1)] = 0
            out_1LNH[:, first:last] = attend(
                q_LNH[None, first:last],
                kv_2SKH[0][None],
                kv_2SKH[1][None],
                torch.arange(first_position, length)[None],
                self.attn.impl.scale,
                self.window,
                out_transform,
            )
        return out_1LNH


TP_BATCH_MULTIPLE = 64
"""A tensor-parallel generator pads each forward's tokens to a multiple of this (see forward)."""


class TorchTitanForCausalLM(nn.Module):
    """vLLM model interface around a torchtitan decoder named by the HF config.

    The engine passes `hf_overrides={"architectures": ["TorchTitanForCausalLM"],
    "torchtitan_model": name, "torchtitan_flavor": flavor, "torchtitan_packed_gemm": bool}`;
    vLLM sizes its KV cache from the HF-shaped config.json, which must describe the same shapes
    as the flavor.
    """

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        hf_config = vllm_config.model_config.hf_config
        self.spec = model_spec(hf_config.torchtitan_model, hf_config.torchtitan_flavor)
        self.tp = vllm_config.parallel_config.tensor_parallel_size
        if self.tp > 1:
            ep = self.tp if getattr(hf_config, "torchtitan_expert_parallel", False) else 1
            self.dims, self.parallelism = _tp_layout(self.spec, self.tp, ep)
        model = self.spec.model.build()
        invariant = getattr(hf_config, "torchtitan_batch_invariant", False)
        layer_configs = self.spec.model.layers
        for (index, layer), config in zip(model.layers.items(), layer_configs, strict=True):
            attention = layer.attention
            layer.attention.inner_attention = PagedAttention(
                n_heads=attention.n_heads // self.tp,
                n_kv_heads=attention.n_kv_heads // self.tp,
                head_dim=attention.head_dim,
                # gpt-oss folds YaRN's attention factor into its softmax scale (its RoPE, which
                # this wrapper runs, does not apply it).
                scale=getattr(attention, "softmax_scale", attention.head_dim**-0.5),
                prefix=f"{prefix}layers.{index}.attention.inner_attention",
                cache_config=vllm_config.cache_config,
                window=getattr(config.attention, "sliding_window_size", None),
                sinks=_local_heads(getattr(attention, "sinks", None), self.tp),
                batch_invariant=invariant,
            )
        if self.tp > 1:
            # The spec's own TP plan, as the trainer applies it, without data parallelism.
            model = self.spec.parallelize_fn(
                model,
                parallel_dims=self.dims,
                training=TrainingConfig(),
                parallelism=self.parallelism,
                compile_config=CompileConfig(enable=False),
                ac_config=None,
                dump_folder="",
                skip_dp=True,
            )
            # vLLM's attention reads the sinks of the rank's heads: the local shard of each
            # layer's sinks parameter, so that weight sync's in-place writes reach it.
            for layer in model.layers.values():
                if getattr(layer.attention, "sinks", None) is not None:
                    sinks = layer.attention.sinks
                    local = sinks.to_local() if isinstance(sinks, DTensor) else sinks
                    layer.attention.inner_attention.attn.impl.sinks = local.detach()
        with torch.no_grad():
            model.init_states()  # computes the RoPE cache; weights come from load_weights
        if invariant:
            # The trainer's kernels on the generator side; no packed copies.
            make_linears_invariant(model)
        elif (
            self.tp == 1  # oneDNN packs a whole weight; a TP shard runs plain GEMMs
            and getattr(hf_config, "torchtitan_packed_gemm", True)
            and _onednn_available(vllm_config.model_config.dtype)
        ):
            for name, module in list(model.named_modules()):
                parent, _, child = name.rpartition(".")
                if isinstance(module, nn.Linear):
                    setattr(model.get_submodule(parent), child, PackedLinear(module))
                elif child == "routed_experts" and PackedExperts.fits(module.inner_experts):
                    setattr(model.get_submodule(parent), child, PackedExperts(module))
        self.model = model
        moe_routers = routers(model)
        self.routing = RoutingLog(moe_routers) if moe_routers else None
        """The experts each request's tokens went to (MoE models; generator/routing.py)."""

    def _replicated(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Under TP, each whole checkpoint tensor as a Replicate DTensor where its parameter is
        a DTensor: torchtitan's fused-QKV load hook then concatenates DTensors, and `copy_`
        keeps each rank's shard of the result."""
        params = dict(self.model.named_parameters())
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
            if isinstance(module, (PackedLinear, PackedExperts)):
                module.repack()

    def drop_packed(self) -> None:
        """Free the packed copies of the weights (until the next `repack`)."""
        for module in self.model.modules():
            if isinstance(module, PackedLinear):
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
        # Under TP the spec's plan splits the tokens over the ranks between layers (sequence
        # parallel), and torchtitan's expert-parallel dispatch assumes equal splits (measured:
        # 441 tokens over 2 ranks failed in the MoE's residual add): pad the batch to a
        # multiple of the ranks. And to a multiple of TP_BATCH_MULTIPLE tokens: DTensor caches
        # its sharding decisions per shape, and every decode step's batch size would otherwise
        # be a new shape (measured, tiny MoE at EP = 2, 8 prompts x 4 samples x 32 tokens:
        # 4.32 s unpadded, 2.29 s at multiples of 16, 1.63 s at 64). vLLM's attention computes
        # only the real rows; the padding's hidden states are dropped at the end.
        T = positions.shape[0]
        pad = -T % math.lcm(self.tp, TP_BATCH_MULTIPLE) if self.tp > 1 else 0
        positions_1T = positions[None]
        if pad:  # (an engine of one rank pads nothing, and copies nothing)
            input_ids = None if input_ids is None else nn.functional.pad(input_ids, (0, pad))
            if inputs_embeds is not None:
                inputs_embeds = nn.functional.pad(inputs_embeds, (0, 0, 0, pad))
            positions_1T = nn.functional.pad(positions, (0, pad))[None]
        if inputs_embeds is not None:
            h_1TD = inputs_embeds[None]
        else:
            h_1TD = self.model.tok_embeddings(input_ids[None])
        for layer in self.model.layers.values():
            layer.attention.inner_attention.tokens = T
            h_1TD = layer(h_1TD, None, positions_1T)
        if self.routing is not None:
            self.routing.commit(positions, _query_start_loc())
        return _whole(self.model.norm(h_1TD)[0])[:T]

    def compute_logits(self, hidden_states_TD: torch.Tensor) -> torch.Tensor:
        """Every TP rank's sampler reads the whole vocabulary."""
        return _whole(self.model.lm_head(hidden_states_TD))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors through the spec's adapter; returns our parameter names.

        Streamed: vLLM's iterator reads one tensor at a time, and each decoder layer is loaded
        as soon as all of its tensors have arrived, so at most one layer's worth of checkpoint
        tensors is held besides the model (not a second copy of the whole model).
        """
        adapter = self.spec.state_dict_adapter(self.spec.model, None)
        expected = set(hf_shapes(self.spec))
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
        return {name for name, _ in self.named_parameters()}


def _local_heads(sinks: torch.Tensor | None, tp: int) -> torch.Tensor | None:
    """What vLLM's attention is built with for a layer's sinks: the parameter itself, or under
    TP a stand-in of the rank's heads (the parameter's shard replaces it once the TP plan has
    sharded it)."""
    if sinks is None or tp == 1:
        return sinks
    return sinks.new_zeros(sinks.shape[0] // tp)


def _tp_layout(spec, tp: int, ep: int):
    """torchtitan's view of a generator sharded `tp` ways (its TP groups are consecutive
    ranks, as vLLM's), its experts `ep` ways (1, or tp: whole experts over the TP ranks), with
    the spec's sharding plan filled in as the trainer's is."""
    import torch.distributed as dist

    from torchtitan_rl.config import ParallelismSection
    from torchtitan_rl.trainer.parallel import fill_sharding_plan, layout

    world = dist.get_world_size()
    dims, parallelism = layout(ParallelismSection(dp_shard=world // tp, tp=tp, ep=ep), world)
    fill_sharding_plan(spec, parallelism)
    return dims, parallelism


def _whole(x: torch.Tensor) -> torch.Tensor:
    """A TP DTensor gathered to the plain whole tensor vLLM expects (a plain tensor as is)."""
    return x.full_tensor() if isinstance(x, DTensor) else x


def _attention_metadata(layer_name: str | None = None):
    """This forward's attention metadata: `layer_name`'s, or any layer's (None: none, as in
    a dummy run)."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    metadata = get_forward_context().attn_metadata
    if isinstance(metadata, list):
        metadata = metadata[0] if metadata else None
    if isinstance(metadata, dict):
        if layer_name is None:
            return next(iter(metadata.values()), None)
        return metadata.get(layer_name)
    return metadata


def _query_start_loc() -> torch.Tensor | None:
    """Where each request's rows start in this forward's flat batch (None: a dummy run)."""
    metadata = _attention_metadata()
    return None if metadata is None else metadata.query_start_loc


def _layer_of(hf_name: str) -> str:
    """The group an HF tensor loads with: its decoder layer ("model.layers.3"), or "rest"
    (embedding, final norm, lm_head), loaded last."""
    parts = hf_name.split(".")
    return ".".join(parts[:3]) if parts[1:2] == ["layers"] else "rest"
