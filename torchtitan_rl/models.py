"""Model specs: torchtitan's registries plus the tiny flavors this project ships.

    .venv/bin/python -c "from torchtitan_rl.models import flavors; print(flavors('qwen3'))"

Every model the trainer and the generator build comes from `model_spec(name, flavor)`, so both
sides share one definition. Flavors are torchtitan's (`debugmodel`, `0.6B`, ...) plus the
`tiny` flavors below, sized for CPU tests and the demo (they match the checkpoint that
`scripts/make_tiny_checkpoint.py` writes).
"""

import importlib
from collections.abc import Callable
from pathlib import Path

from torchtitan.protocols.model_spec import ModelSpec

# Not from the package: torchtitan_rl.config.job imports this module.
from torchtitan_rl.config.errors import read_json

# Model names whose torchtitan spec this project supports (dense decoders with an HF adapter).
SUPPORTED_MODELS = ("qwen3", "llama3")


def _qwen3_tiny(attn_backend: str):
    # torchtitan builds its Qwen3 flavors with this private helper; reusing it keeps our tiny
    # flavor identical in structure (fused QKV, QK-norm, tied embeddings) to the real ones.
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.qwen3 import (
        _EMBEDDING_SKIP_INIT,
        _LINEAR_INIT,
        _build_qwen3_layers,
        _qwen3_norm,
    )
    from torchtitan.models.qwen3.model import Qwen3Model

    dim, head_dim, vocab_size = 128, 32, 68
    return Qwen3Model.Config(
        vocab_size=vocab_size,
        dim=dim,
        norm=_qwen3_norm(dim),
        enable_weight_tying=True,
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab_size, embedding_dim=dim, param_init=_EMBEDDING_SKIP_INIT
        ),
        lm_head=Linear.Config(in_features=dim, out_features=vocab_size, param_init=_LINEAR_INIT),
        layers=_build_qwen3_layers(
            n_layers=2,
            dim=dim,
            n_heads=4,
            n_kv_heads=2,
            head_dim=head_dim,
            hidden_dim=256,
            attn_backend=attn_backend,
            rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=1024, theta=1000000.0),
        ),
    )


def _llama3_tiny(attn_backend: str):
    # Same construction as torchtitan's own Llama3 flavors (private helpers reused on purpose),
    # with Llama 3.1 RoPE scaling, GQA and tied embeddings, at the tiny Qwen3's size.
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear
    from torchtitan.models.common.nn_modules import RMSNorm
    from torchtitan.models.llama3 import (
        _EMBEDDING_SKIP_INIT,
        _NORM_INIT,
        _build_llama3_layers,
        _output_linear_init,
    )
    from torchtitan.models.llama3.model import Llama3Model

    dim, n_heads, vocab_size = 128, 4, 68
    return Llama3Model.Config(
        dim=dim,
        vocab_size=vocab_size,
        enable_weight_tying=True,
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab_size, embedding_dim=dim, param_init=_EMBEDDING_SKIP_INIT
        ),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(
            in_features=dim, out_features=vocab_size, param_init=_output_linear_init(dim)
        ),
        layers=_build_llama3_layers(
            n_layers=2,
            dim=dim,
            n_heads=n_heads,
            n_kv_heads=2,
            hidden_dim=256,
            rope=ComplexRoPE.Config(
                dim=dim // n_heads, max_seq_len=1024, theta=500000, scaling="llama"
            ),
            attn_backend=attn_backend,
        ),
    )


# Flavors this project adds to torchtitan's registries: {model name: {flavor: config factory}}.
EXTRA_FLAVORS: dict[str, dict[str, Callable]] = {
    "qwen3": {"tiny": _qwen3_tiny},
    "llama3": {"tiny": _llama3_tiny},
}


def flavors(name: str) -> list[str]:
    """All flavor names available for model `name` (torchtitan's and ours)."""
    module = importlib.import_module(f"torchtitan.models.{name}")
    registry = getattr(module, f"{name}_configs")
    return sorted({*registry, *EXTRA_FLAVORS.get(name, {})})


def is_mixture_of_experts(name: str, flavor: str) -> bool:
    """Whether any layer of `name`/`flavor` routes tokens to experts (its config has a `moe`)."""
    layers = model_spec(name, flavor).model.layers
    return any(getattr(layer, "moe", None) is not None for layer in layers)


def model_spec(name: str, flavor: str, attn_backend: str = "flex") -> ModelSpec:
    """The torchtitan `ModelSpec` for `name`/`flavor`; `attn_backend` picks the inner attention."""
    module = importlib.import_module(f"torchtitan.models.{name}")
    extra = EXTRA_FLAVORS.get(name, {})
    if flavor not in extra:
        return module.model_registry(flavor, attn_backend=attn_backend)
    base = module.model_registry("debugmodel", attn_backend=attn_backend)
    base.flavor = flavor
    base.model = extra[flavor](attn_backend)
    return base


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
