"""The tiny flavors this project adds to torchtitan's registries, sized for CPU tests and the
demo (they match the checkpoints `scripts/make_tiny_checkpoint.py` writes).

    .venv/bin/python -c "from torchtitan_rl.models import flavors; print(flavors('qwen3'))"

Each reuses the private helpers torchtitan builds its own flavors with, so a tiny model has the
real ones' structure: fused QKV, QK-norm, tied embeddings, and for `tiny_moe` Qwen3-MoE's
router (softmax, top-k renormalized) and SwiGLU experts.
"""

from collections.abc import Callable

# The tokenizer's alphabet fits 68 ids; every tiny flavor shares it (make_tiny_checkpoint.py).
VOCAB_SIZE, DIM, HEAD_DIM = 68, 128, 32


def _qwen3(attn_backend: str, build_layers, **layer_sizes):
    """A tiny Qwen3 config whose decoder layers `build_layers` (torchtitan's dense or MoE
    layer builder) makes with the shared attention sizes and `layer_sizes`."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.qwen3 import _EMBEDDING_SKIP_INIT, _LINEAR_INIT, _qwen3_norm
    from torchtitan.models.qwen3.model import Qwen3Model

    return Qwen3Model.Config(
        vocab_size=VOCAB_SIZE,
        dim=DIM,
        norm=_qwen3_norm(DIM),
        enable_weight_tying=True,
        tok_embeddings=Embedding.Config(
            num_embeddings=VOCAB_SIZE, embedding_dim=DIM, param_init=_EMBEDDING_SKIP_INIT
        ),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB_SIZE, param_init=_LINEAR_INIT),
        layers=build_layers(
            n_layers=2,
            dim=DIM,
            n_heads=4,
            n_kv_heads=2,
            head_dim=HEAD_DIM,
            attn_backend=attn_backend,
            rope=CosSinRoPE.Config(dim=HEAD_DIM, max_seq_len=1024, theta=1000000.0),
            **layer_sizes,
        ),
    )


def qwen3_tiny(attn_backend: str):
    from torchtitan.models.qwen3 import _build_qwen3_layers

    return _qwen3(attn_backend, _build_qwen3_layers, hidden_dim=256)


def qwen3_tiny_moe(attn_backend: str):
    """`tiny` with each MLP replaced by 8 experts of width 64, 2 per token: the same active
    FFN width (128) as half of tiny's MLP, and Qwen3-30B-A3B's router."""
    from torchtitan.models.qwen3 import _build_qwen3_moe_layers

    return _qwen3(
        attn_backend,
        _build_qwen3_moe_layers,
        moe_hidden_dim=64,
        num_experts=8,
        top_k=2,
        moe_comm_backend="standard",
    )


def llama3_tiny(attn_backend: str):
    # Llama 3.1 RoPE scaling, GQA and tied embeddings, at the tiny Qwen3's size.
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear
    from torchtitan.models.common.nn_modules import RMSNorm
    from torchtitan.models.llama3 import (
        _EMBEDDING_SKIP_INIT,
        _NORM_INIT,
        _build_llama3_layers,
        _output_linear_init,
    )
    from torchtitan.models.llama3.model import Llama3Model

    n_heads = 4
    return Llama3Model.Config(
        dim=DIM,
        vocab_size=VOCAB_SIZE,
        enable_weight_tying=True,
        tok_embeddings=Embedding.Config(
            num_embeddings=VOCAB_SIZE, embedding_dim=DIM, param_init=_EMBEDDING_SKIP_INIT
        ),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=_NORM_INIT),
        lm_head=Linear.Config(
            in_features=DIM, out_features=VOCAB_SIZE, param_init=_output_linear_init(DIM)
        ),
        layers=_build_llama3_layers(
            n_layers=2,
            dim=DIM,
            n_heads=n_heads,
            n_kv_heads=2,
            hidden_dim=256,
            rope=ComplexRoPE.Config(
                dim=DIM // n_heads, max_seq_len=1024, theta=500000, scaling="llama"
            ),
            attn_backend=attn_backend,
        ),
    )


# {model name: {flavor: config factory(attn_backend)}}
EXTRA_FLAVORS: dict[str, dict[str, Callable]] = {
    "qwen3": {"tiny": qwen3_tiny, "tiny_moe": qwen3_tiny_moe},
    "llama3": {"tiny": llama3_tiny},
}
