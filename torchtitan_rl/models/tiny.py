"""The tiny flavors this project adds to torchtitan's registries, sized for CPU tests and the
demo (they match the checkpoints `scripts/make_tiny_checkpoint.py` writes).

    .venv/bin/python -c "from torchtitan_rl.models import flavors; print(flavors('qwen3'))"

Each reuses the private helpers torchtitan builds its own flavors with, so a tiny model has the
real ones' structure: fused QKV, QK-norm, tied embeddings, and for `tiny_moe` Qwen3-MoE's
router (softmax, top-k renormalized) and SwiGLU experts; gpt-oss's `tiny`: attention sinks,
a sliding window on every other layer, YaRN RoPE, biased projections and clamped SwiGLU
experts.
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


GPT_OSS_WINDOW = 16
"""The tiny gpt-oss's sliding window (gpt-oss's is 128): shorter than the tests' sequences, so
they cross it."""


def gpt_oss_tiny(attn_backend: str):
    """gpt-oss at the tiny size: 2 layers (the first with a sliding window, as gpt-oss's even
    layers), 4 heads over 2 kv heads with sinks, 8 experts of width 64 (top 2) with biases, and
    gpt-oss's YaRN RoPE (factor 32) over an original context of 32 tokens, so the tests'
    positions reach its scaled frequencies."""
    from torchtitan.models.common import CosSinRoPE

    rope = CosSinRoPE.Config(
        dim=HEAD_DIM,
        max_seq_len=1024,
        theta=150000.0,
        scaling="yarn",
        rope_factor=32,
        beta_fast=32.0,
        beta_slow=1.0,
        truncate=False,
        original_seq_len=32,
    )
    return gpt_oss_config(
        attn_backend,
        vocab_size=VOCAB_SIZE,
        dim=DIM,
        n_heads=4,
        n_kv_heads=2,
        head_dim=HEAD_DIM,
        windows=[GPT_OSS_WINDOW, None],
        num_experts=8,
        top_k=2,
        moe_hidden_dim=64,
        swiglu_limit=7.0,
        rope=rope,
    )


def gpt_oss_config(
    attn_backend: str,
    *,
    vocab_size: int,
    dim: int,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    windows: list[int | None],
    num_experts: int,
    top_k: int,
    moe_hidden_dim: int,
    swiglu_limit: float,
    rope,
):
    """A gpt-oss config of any size (the tiny flavor's, and a checkpoint's: from_hf.py): a layer
    per entry of `windows` (its sliding window, None: full attention), attention sinks, biased
    projections, `num_experts` clamped-SwiGLU experts of `moe_hidden_dim` (top `top_k`) with
    biases. torchtitan's layer builder fixes 64 heads and a 128 window, so the layers are built
    here with its per-layer helpers."""
    import dataclasses

    from torchtitan.models.common import Linear, RMSNorm
    from torchtitan.models.common.moe import TokenChoiceTopKRouter
    from torchtitan.models.gpt_oss import (
        _EMBEDDING_INIT,
        _NORM_INIT,
        _depth_init,
        _make_gptoss_attn_config,
        _make_gptoss_experts_config,
        _output_linear_init,
    )
    from torchtitan.models.gpt_oss.model import GptOssModel, GptOssTransformerBlock
    from torchtitan.models.gpt_oss.moe import GptOssMoE

    layers = []
    for layer_id, window in enumerate(windows):
        router = TokenChoiceTopKRouter.Config(
            num_experts=num_experts,
            score_func="softmax",
            route_norm=True,
            gate=Linear.Config(
                in_features=dim,
                out_features=num_experts,
                bias=True,
                param_init=_depth_init(layer_id),
            ),
            top_k=top_k,
        )
        routed = _make_gptoss_experts_config(
            dim=dim,
            hidden_dim=moe_hidden_dim,
            num_experts=num_experts,
            layer_id=layer_id,
            top_k=top_k,
            moe_comm_backend="standard",
        )
        routed.inner_experts = dataclasses.replace(routed.inner_experts, swiglu_limit=swiglu_limit)
        attention = _make_gptoss_attn_config(
            dim=dim,
            layer_id=layer_id,
            attn_backend=attn_backend,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            sliding_window_size=window,
            rope=rope,
        )
        layers.append(
            GptOssTransformerBlock.Config(
                attention=attention,
                attention_norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
                ffn_norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
                moe=GptOssMoE.Config(
                    num_experts=num_experts,
                    load_balance_coeff=1e-3,
                    routed_experts=routed,
                    router=router,
                ),
            )
        )
    return _untied(
        GptOssModel.Config,
        layers,
        _EMBEDDING_INIT,
        _NORM_INIT,
        _output_linear_init(dim),
        vocab_size,
        dim,
    )


DEEPSEEK_ROPE_ORIGINAL = 32
"""The tiny DeepSeek-V3's YaRN original context (DeepSeek-V3's is 4096): shorter than the
tests' sequences, so their positions reach the scaled frequencies."""


def deepseek_v3_tiny(attn_backend: str, groups: tuple[int, int] | None = None):
    """DeepSeek-V3 at the tiny size: multi-head latent attention (a query LoRA of rank 32, a
    KV latent of rank 64, q/k heads of 32 + 32 RoPE dims, v heads of 32), YaRN RoPE (factor 40)
    folded into the softmax scale, a dense first layer, then 8 routed experts of width 64
    (top 2, sigmoid scores with the correction bias, renormalized and scaled by 2.5) beside one
    shared expert. `groups` = (n_group, topk_group): DeepSeek-V3's group-limited routing (one
    group, as HF's class implements for V3 checkpoints, when None)."""
    from torchtitan.models.deepseek_v3 import _build_dsv3_layers
    from torchtitan.models.deepseek_v3.model import DeepSeekV3Model

    return _mla(attn_backend, DeepSeekV3Model.Config, _build_dsv3_layers, groups, 10000.0, 2.5)


def kimi_k2_7_tiny(attn_backend: str):
    """Kimi K2's text tower at the tiny size: DeepSeek-V3's `tiny` with Kimi's RoPE base
    (50000) and routed scale (2.827), one routing group, and no vision tower."""
    from torchtitan.models.kimi_k2_7 import _build_kimi_layers
    from torchtitan.models.kimi_k2_7.model import KimiK25Model

    return _mla(attn_backend, KimiK25Model.Config, _build_kimi_layers, None, 50000.0, 2.827)


def _mla(attn_backend, model_config, build_layers, groups, theta: float, route_scale: float):
    """A tiny DeepSeek-V3-architecture config (deepseek_v3_tiny's sizes) of `model_config`'s
    class, its layers from the family's `build_layers`."""
    from torchtitan.models.common import ComplexRoPE

    n_group, topk_group = groups or (None, None)
    rope_dim = 32
    return mla_config(
        attn_backend,
        model_config,
        build_layers,
        vocab_size=VOCAB_SIZE,
        n_layers=2,
        n_dense_layers=1,
        dim=DIM,
        n_heads=4,
        q_lora_rank=32,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=rope_dim,
        v_head_dim=32,
        mscale=1.0,
        dense_hidden_dim=256,
        moe_hidden_dim=64,
        num_experts=8,
        num_shared_experts=1,
        router_top_k=2,
        router_score_func="sigmoid",
        router_num_expert_groups=n_group,
        router_num_limited_groups=topk_group,
        router_route_scale=route_scale,
        router_route_norm=True,
        rope=ComplexRoPE.Config(
            dim=rope_dim,
            max_seq_len=40 * DEEPSEEK_ROPE_ORIGINAL,
            theta=theta,
            scaling="yarn",
            rope_factor=40.0,
            beta_fast=32.0,
            beta_slow=1.0,
            original_seq_len=DEEPSEEK_ROPE_ORIGINAL,
        ),
    )


def mla_config(attn_backend, model_config, build_layers, *, vocab_size: int, dim: int, **sizes):
    """A DeepSeek-V3-architecture config of any size (the tiny flavors', and a checkpoint's:
    from_hf.py) of `model_config`'s class (DeepSeek-V3's or Kimi's), its layers from the
    family's `build_layers` with `sizes` (torchtitan's `build_mla_moe_layers` arguments),
    untied."""
    from torchtitan.models.deepseek_v3 import _EMBEDDING_INIT, _NORM_INIT, _output_linear_init

    layers = build_layers(
        dim=dim,
        attn_backend=attn_backend,
        moe_comm_backend="standard",
        non_blocking_capacity_factor=None,
        **sizes,
    )
    return _untied(
        model_config,
        layers,
        _EMBEDDING_INIT,
        _NORM_INIT,
        _output_linear_init(dim),
        vocab_size,
        dim,
    )


def deepseek_v3_tiny_grouped(attn_backend: str):
    """`tiny` with group-limited routing: 4 groups of 2 experts, each token's experts from its
    2 best groups (DeepSeek-V3: 8 groups, 4 kept)."""
    return deepseek_v3_tiny(attn_backend, groups=(4, 2))


def _untied(
    model_config, layers, embedding_init, norm_init, output_init, vocab_size=VOCAB_SIZE, dim=DIM
):
    """A `model_config` (a family's model Config class) over `layers` (tiny sizes unless
    given), its embedding, final norm and LM head untied, each with the family's initializer."""
    from torchtitan.models.common import Embedding, Linear, RMSNorm

    return model_config(
        vocab_size=vocab_size,
        dim=dim,
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab_size, embedding_dim=dim, param_init=embedding_init
        ),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=norm_init),
        lm_head=Linear.Config(in_features=dim, out_features=vocab_size, param_init=output_init),
        layers=layers,
    )


MUSE_GLIMMER_WINDOW = 16
"""The tiny Muse Glimmer's sliding window (Muse Glimmer 30B's is 2048): shorter than the tests'
sequences, so that its sliding layers drop keys."""


def muse_glimmer_tiny(attn_backend: str, vocab_size: int = VOCAB_SIZE, **vision):
    """Muse Glimmer's text tower at the tiny size: 4 layers, three with RoPE and a sliding
    window, the last one global and without RoPE (iRoPE, as every fourth layer of the 30B);
    QK-norm with the query scaled after it, a sigmoid gate on the attention output, gain-centred
    norms before and after each sub-layer, a scaleless norm on the embeddings, untied, and an
    LM head whose logits are scaled and tanh soft-capped. The cap is 5 (the 30B's: 20) and the
    multiplier 2, so that the cap bends logits of a random model's size. `vision`: the vision
    tower's configs (`muse_glimmer_tiny_vl`)."""
    import dataclasses

    from torchtitan.models.muse_glimmer import _muse_glimmer_config

    config = _muse_glimmer_config(
        dim=DIM,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        head_dim=HEAD_DIM,
        vocab_size=vocab_size,
        max_seq_len=4096,
        window_pattern=[MUSE_GLIMMER_WINDOW] * 3 + [0],
        output_multiplier=2.0,
        attn_backend=attn_backend,
        **vision,
    )
    config.lm_head = dataclasses.replace(config.lm_head, output_soft_cap_temp=5.0)
    return config


VL_VOCAB_SIZE = 72
"""The vision-language tiny Muse Glimmer's vocabulary: the tiny alphabet's 68 ids plus the image
markers `<|patch|>`, `<|image_start|>`, `<|image_end|>`, and one unused id (a multiple of 8)."""


def muse_glimmer_tiny_vl(attn_backend: str):
    """`tiny` with Muse Glimmer's vision tower, at the tiny size: an encoder of 2 layers of
    width 32 (2 heads), windowed attention over 2x2 patch windows in the first layer and global
    in the last, as the 30B's 50 layers alternate; 14-px patches of 2 frames, merged 2x2 into
    one 128-wide token; the adapter's two linears to 64, and the decoder's projection to its
    width. Its vocabulary holds the image markers (VL_VOCAB_SIZE)."""
    from torchtitan.models.muse_glimmer import (
        muse_glimmer_vision_adapter_config,
        muse_glimmer_vision_encoder_config,
    )

    encoder = muse_glimmer_vision_encoder_config(
        latent_dim=32,
        num_layers=2,
        num_heads=2,
        mlp_ratio=2.0,
        pos_emb_grid_h=2,
        pos_emb_grid_w=2,
    )
    adapter = muse_glimmer_vision_adapter_config(input_dim=encoder.output_dim, output_dim=64)
    return muse_glimmer_tiny(
        attn_backend,
        VL_VOCAB_SIZE,
        vision_adapter_dim=64,
        vision_encoder=encoder,
        vision_adapter=adapter,
    )


def qwen3_5_tiny(attn_backend: str, moe: bool = False):
    """Qwen3.5's text model at the tiny size: 4 layers, three Gated DeltaNet (2 key heads
    repeated to 4 value heads of 64, the smallest vLLM's own CPU kernels take, and a width-4
    causal convolution) and the fourth gated full
    attention (QK-norm, RoPE on the first quarter of each head: 8 of 32 dims), offset norms,
    untied. `moe`: each MLP replaced by 8 experts of width 64, 2 per token, plus the
    sigmoid-gated shared expert (Qwen3.5-35B-A3B's structure)."""
    from torchtitan_rl.models.qwen3_5 import family

    q35 = family()
    sizes = dict(
        n_layers=4,
        dim=DIM,
        n_heads=4,
        n_kv_heads=2,
        head_dim=HEAD_DIM,
        rotary_dim=HEAD_DIM // 4,
        rope=q35.MRoPE.Config(
            dim=HEAD_DIM // 4, max_seq_len=4096, theta=10_000_000.0, mrope_section=[2, 1, 1]
        ),
        n_key_heads=2,
        n_value_heads=4,
        key_head_dim=2 * HEAD_DIM,
        value_head_dim=2 * HEAD_DIM,
        attn_backend=attn_backend,
    )
    if moe:
        layers = q35._build_qwen35_moe_layers(
            moe_hidden_dim=64, num_experts=8, top_k=2, shared_expert_hidden_dim=64, **sizes
        )
    else:
        layers = q35._build_qwen35_layers(hidden_dim=256, **sizes)
    return qwen3_5_text_config(VOCAB_SIZE, DIM, layers)


def qwen3_5_text_config(vocab: int, dim: int, layers: list):
    """Qwen3.5's text model over `layers`: embedding, offset final norm and untied LM head of
    torchtitan's initializers (the tiny flavor and a config.json's)."""
    from torchtitan.models.common import Embedding, Linear

    from torchtitan_rl.models.qwen3_5 import family, text_only

    q35 = family()
    config = q35.Qwen35Model.Config(
        vocab_size=vocab,
        dim=dim,
        norm=q35._offset_norm(dim),
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab, embedding_dim=dim, param_init=q35._EMBEDDING_INIT
        ),
        lm_head=Linear.Config(
            in_features=dim, out_features=vocab, param_init=q35._output_linear_init(dim)
        ),
        layers=layers,
        vision_encoder=None,
    )
    return text_only(config)


def qwen3_5_tiny_moe(attn_backend: str):
    return qwen3_5_tiny(attn_backend, moe=True)


# {model name: {flavor: config factory(attn_backend)}}
EXTRA_FLAVORS: dict[str, dict[str, Callable]] = {
    "qwen3": {"tiny": qwen3_tiny, "tiny_moe": qwen3_tiny_moe},
    "llama3": {"tiny": llama3_tiny},
    "gpt_oss": {"tiny": gpt_oss_tiny},
    "deepseek_v3": {"tiny": deepseek_v3_tiny, "tiny_grouped": deepseek_v3_tiny_grouped},
    "kimi_k2_7": {"tiny": kimi_k2_7_tiny},
    "muse_glimmer": {"tiny": muse_glimmer_tiny, "tiny_vl": muse_glimmer_tiny_vl},
    "qwen3_5": {"tiny": qwen3_5_tiny, "tiny_moe": qwen3_5_tiny_moe},
}
