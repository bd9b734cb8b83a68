"""Model specs: torchtitan's families and registries plus the tiny flavors this project ships.

    .venv/bin/python -c "from torchtitan_rl.models import flavors; print(flavors('qwen3'))"

Every model the trainer and the generator build comes from `model_spec(name, flavor)`, so both
sides share one definition: torchtitan's flavors (`debugmodel`, `0.6B`, `debugmodel_moe`,
`30B-A3B`, ...), the `tiny` ones (tiny.py), and `auto:<folder>`, read from a checkpoint's
config.json (from_hf.py). Which families run, and why the others are
refused: families.py. Mixture-of-experts layers build this project's `Experts` and `Router`
(moe.py), with torchtitan's parameter names and routing.
"""

import importlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.protocols.module import Module

# Not from the package: torchtitan_rl.config.job imports this module.
from torchtitan_rl.config.errors import read_json
from torchtitan_rl.models import from_hf
from torchtitan_rl.models.families import FAMILIES, SUPPORTED_MODELS, Family  # noqa: F401
from torchtitan_rl.models.gpt_oss import GptOssAdapter
from torchtitan_rl.models.moe import use_project_moe
from torchtitan_rl.models.tiny import EXTRA_FLAVORS
from torchtitan_rl.models.vision import parallelize_vision_language, use_vision_language_model


def family_module(name: str):
    """torchtitan's package of model family `name` (Qwen3.5's through models/qwen3_5.py, which
    stands in for `fla` where it is not installed)."""
    if name == "qwen3_5":
        from torchtitan_rl.models import qwen3_5

        return qwen3_5.family()
    return importlib.import_module(f"torchtitan.models.{name}")


def flavors(name: str) -> list[str]:
    """All flavor names available for model `name` (torchtitan's and ours)."""
    module = family_module(name)
    registry = getattr(module, FAMILIES[name].registry)
    return sorted({*registry, *EXTRA_FLAVORS.get(name, {})})


def expert_counts(name: str, flavor: str) -> set[int]:
    """The expert counts of `name`/`flavor`'s MoE layers (the layers whose config has a `moe`);
    empty for a dense model."""
    layers = _config(name, flavor).layers
    return {layer.moe.num_experts for layer in layers if getattr(layer, "moe", None) is not None}


def refused_parts(name: str, flavor: str) -> str:
    """Why `name`/`flavor` cannot run though its family can ('' where it can): a vision tower
    but Muse Glimmer's (Kimi K2.5's flavors but moonlight-16B-A3B), multi-token-prediction
    layers."""
    config = _config(name, flavor)
    if getattr(config, "vision_encoder", None) is not None and name != "muse_glimmer":
        return "builds a vision tower (image and video inputs), which this project does not run"
    if getattr(config, "mtp_layers", None):
        return "has multi-token-prediction layers, which this project does not train"
    return ""


def has_vision_tower(name: str, flavor: str) -> bool:
    """Whether `name`/`flavor` reads images (Muse Glimmer's vision flavors: models/vision.py)."""
    return getattr(_config(name, flavor), "vision_encoder", None) is not None


def is_mixture_of_experts(name: str, flavor: str) -> bool:
    """Whether any layer of `name`/`flavor` routes tokens to experts."""
    return bool(expert_counts(name, flavor))


def has_linear_attention(name: str, flavor: str) -> bool:
    """Whether any layer of `name`/`flavor` is Gated DeltaNet (Qwen3.5's linear attention),
    whose per-sequence state the generator keeps in vLLM's slots."""
    return linear_attention_heads(name, flavor) is not None


def linear_attention_heads(name: str, flavor: str) -> tuple[int, int] | None:
    """(key heads, value heads) of `name`/`flavor`'s Gated DeltaNet layers; None without."""
    for layer in _config(name, flavor).layers:
        delta_net = getattr(layer, "delta_net", None)
        if delta_net is not None:
            return (
                delta_net.in_proj_q.out_features // delta_net.key_head_dim,
                delta_net.in_proj_v.out_features // delta_net.value_head_dim,
            )
    return None


def hf_architecture(name: str, flavor: str) -> str | None:
    """The HF architecture of `name`/`flavor`'s checkpoints (Qwen3MoeForCausalLM, ...)."""
    return FAMILIES[name].hf_architectures[int(is_mixture_of_experts(name, flavor))]


def _config(name: str, flavor: str, attn_backend: str = "flex"):
    if from_hf.checkpoint_of(flavor) is not None:
        return from_hf.derived_config(name, flavor, attn_backend)
    extra = EXTRA_FLAVORS.get(name, {})
    if flavor in extra:
        return extra[flavor](attn_backend)
    # Through the family's model_registry: its factories' arguments differ (gpt_oss's need a
    # moe_comm_backend).
    config = family_module(name).model_registry(flavor, attn_backend=attn_backend).model
    if name == "qwen3_5":  # every flavor of torchtitan's builds a vision encoder
        from torchtitan_rl.models.qwen3_5 import text_only

        return text_only(config)
    return config


@dataclass(frozen=True, slots=True)
class AttentionShape:
    """What the inner attention of a layer computes over: `heads` query heads of `head_dim`
    over `kv_heads` key/value heads, values of `v_head_dim`."""

    heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int


def attention_shape(attention, dim: int) -> AttentionShape:
    """The inner attention's shape of a layer's attention (its config or the built module).
    Multi-head latent attention (DeepSeek-V3's: a `kv_lora_rank`) hands it keys and values
    decompressed per head: q/k heads of the no-RoPE plus the RoPE dims, v heads their own."""
    if hasattr(attention, "kv_lora_rank"):
        qk = attention.qk_nope_head_dim + attention.qk_rope_head_dim
        return AttentionShape(attention.n_heads, attention.n_heads, qk, attention.v_head_dim)
    head_dim = attention.head_dim or dim // attention.n_heads
    kv_heads = attention.n_kv_heads or attention.n_heads
    return AttentionShape(attention.n_heads, kv_heads, head_dim, head_dim)


def describe(name: str, config) -> str:
    """One line of a model config's shape (what --job.dry_run prints for a derived flavor)."""
    layers = config.layers
    shape = attention_shape(layers[0].attention, config.dim)
    heads = f"{shape.heads} heads / {shape.kv_heads} KV heads of {shape.head_dim}"
    moe = next((layer.moe for layer in layers if getattr(layer, "moe", None) is not None), None)
    if moe is not None:
        experts = moe.routed_experts.inner_experts
        ffn = f"{moe.num_experts} experts of {experts.hidden_dim} (top {moe.router.top_k})"
    else:
        ffn = f"FFN {layers[0].feed_forward.w1.out_features}"
    rope = layers[0].attention.rope
    tied = "tied" if config.enable_weight_tying else "untied"
    encoder = getattr(config, "vision_encoder", None)
    vision = (
        "" if encoder is None else f"; vision: {encoder.num_layers} layers of {encoder.latent_dim}"
    )
    return (
        f"{name}: {len(layers)} layers, dim {config.dim}, {heads}, {ffn}, "
        f"vocab {config.vocab_size} ({tied}), RoPE theta {rope.theta:g} ({rope.scaling}), "
        f"norm eps {config.norm.eps:g}, {rope.max_seq_len} positions{vision}"
    )


def model_spec(name: str, flavor: str, attn_backend: str = "flex") -> ModelSpec:
    """The torchtitan `ModelSpec` for `name`/`flavor`; `attn_backend` picks the inner attention.

    MoE layers get this project's modules (`moe.use_project_moe`). torchtitan's spec installs
    its load-balancing hook through `post_optimizer_build_fn`; this project never calls it, so
    the routers' `expert_bias_E` stays what the checkpoint gave (docs/moe.md).
    """
    from torchtitan.distributed import utils as dist_utils

    from torchtitan_rl import platform

    # Process-wide, as torchtitan's Trainer sets it before building: Muse Glimmer's forward
    # asserts "spmd_types" placements (the default) against a mesh nothing here sets.
    dist_utils.set_spmd_backend(platform.spmd_backend())
    spec = family_module(name).model_registry("debugmodel", attn_backend=attn_backend)
    spec.name = name  # kimi_k2_7's spec names itself kimi_k2_5
    spec.flavor = flavor
    spec.model = _config(name, flavor, attn_backend)
    if name == "gpt_oss":  # torchtitan's drops the experts (models/gpt_oss.py)
        spec.state_dict_adapter = GptOssAdapter
    if name == "muse_glimmer":
        spec.parallelize_fn = parallelize_vision_language
        spec.model = use_vision_language_model(spec.model)
    if name == "qwen3_5":
        from torchtitan_rl.models.qwen3_5 import adapter_class

        spec.state_dict_adapter = adapter_class()
    use_project_moe(spec.model)
    return spec


def weights(module: torch.nn.Module, prefix_to_drop: str = "") -> dict[str, torch.Tensor]:
    """What weight sync carries, by FQN: every parameter (tied ones once) and every persistent
    buffer of a torchtitan module, which the forward reads (the MoE routers' `expert_bias_E`).
    Non-persistent buffers are derived (RoPE caches) or statistics (the experts' token
    counts), and vLLM's own modules' buffers (its attention's KV scales) are the engine's.
    `prefix_to_drop`: a wrapper's infix to remove from names (activation checkpointing)."""
    found = dict(module.named_parameters())
    for owner_name, owner in module.named_modules():
        if not isinstance(owner, Module):
            continue
        for name, buffer in owner._buffers.items():
            if buffer is not None and name not in owner._non_persistent_buffers_set:
                found[f"{owner_name}.{name}" if owner_name else name] = buffer
    return {name.replace(prefix_to_drop, ""): tensor for name, tensor in found.items()}


def checkpoint_stop_ids(hf_checkpoint: str, field: str = "model.hf_checkpoint") -> list[int]:
    """Every id that ends a completion for the checkpoint: the eos_token_id of its
    generation_config.json (an int or a list: Qwen3 lists <|im_end|> and <|endoftext|>), else
    of its config.json. `field`: the config field naming the folder, for a damaged file."""
    for name in ("generation_config.json", "config.json"):
        if (Path(hf_checkpoint) / name).is_file():
            eos = read_json(hf_checkpoint, name, field).get("eos_token_id")
            if eos is not None:
                return [eos] if isinstance(eos, int) else list(eos)
    return []
