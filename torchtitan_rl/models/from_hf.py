"""Model configs read from an HF checkpoint's config.json: `model.flavor = "auto"`.

    .venv/bin/python -m pytest tests/unit/test_from_hf.py

torchtitan registers fixed sizes (`debugmodel`, `0.6B`, `30B-A3B`, ...); an HF checkpoint of any
other shape (SmolLM2, TinyLlama, a pruned or distilled model) has no flavor. With
`model.flavor = "auto"` the flavor is `auto:<checkpoint folder>`, and its config is built here
from the folder's config.json with the family's own torchtitan layer builders, so the trainer,
the generator (which gets the flavor string through hf_overrides), weight sync, LoRA and the
export take it as they take a named one.

Every config.json field that changes what the model computes is read or checked: a value
torchtitan's model cannot express (attention biases, a RoPE type it lacks, sliding windows in
Qwen3, an activation but SiLU) is one ConfigError line naming the field and its value. Fields
that change nothing (token ids, dtype, initializer range, cache flags) are not read.
"""

from pathlib import Path

from torchtitan_rl.config.errors import read_json
from torchtitan_rl.models.from_hf_muse_glimmer import muse_glimmer
from torchtitan_rl.models.hf_fields import Fields, set_norm_eps

AUTO = "auto"
"""`model.flavor`'s default: the flavor of model.hf_checkpoint's config.json."""
PREFIX = "auto:"
"""A derived flavor is this prefix and the checkpoint folder."""


def derived_flavor(checkpoint: str) -> str:
    """The flavor string of `checkpoint`'s config.json (what "auto" resolves to)."""
    return f"{PREFIX}{checkpoint}"


def checkpoint_of(flavor: str) -> str | None:
    """The checkpoint folder of a derived flavor; None for a named one."""
    return flavor.removeprefix(PREFIX) if flavor.startswith(PREFIX) else None


def derived_config(name: str, flavor: str, attn_backend: str):
    """The torchtitan model config of derived `flavor` (auto:<folder>) of family `name`."""
    folder = checkpoint_of(flavor)
    fields = Fields(read_json(folder, "config.json", "model.hf_checkpoint"), folder)
    return _READERS[name](fields, attn_backend)


def _common(fields: Fields, family: str) -> None:
    """The checks every dense GQA family shares: SiLU gates, no biases, no tensor split."""
    fields.expect("hidden_act", ("silu",), f"is not the SiLU gate of torchtitan's {family} FFN")
    for key in ("attention_bias", "mlp_bias"):
        fields.expect(key, (False,), f"(biased projections) is not in torchtitan's {family}")
    fields.expect("pretraining_tp", (1,), "(split projections) is not in torchtitan's model")


def _decoder(model_config, fields: Fields, layers, init):
    """`model_config` (a family's model Config class) over `layers`: embedding, final norm and
    LM head of config.json's vocabulary, tied as it says. `init`: (embedding, tied embedding,
    norm, LM head) initializers of the family."""
    from torchtitan.models.common import Embedding, Linear, RMSNorm

    vocab, dim = fields.need("vocab_size"), fields.need("hidden_size")
    tied = bool(fields.get("tie_word_embeddings", False))
    embedding_init, tied_init, norm_init, output_init = init
    embedding_init = tied_init if tied else embedding_init
    config = model_config(
        vocab_size=vocab,
        dim=dim,
        enable_weight_tying=tied,
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab,
            embedding_dim=dim,
            param_init=embedding_init,
        ),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=norm_init),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=output_init),
        layers=layers,
    )
    set_norm_eps(config, float(fields.get("rms_norm_eps", 1e-6)))
    return config


def _llama3(fields: Fields, attn_backend: str):
    """LlamaForCausalLM: Llama 2/3, SmolLM, TinyLlama. RoPE: none or Llama 3's scaling."""
    from torchtitan.models import llama3
    from torchtitan.models.common import ComplexRoPE

    _common(fields, "llama3")
    dim, n_heads = fields.need("hidden_size"), fields.need("num_attention_heads")
    if fields.head_dim() != dim // n_heads:
        raise fields.fail(
            "head_dim", fields.head_dim(), f"differs from hidden_size / heads ({dim // n_heads})"
        )
    rope = fields.rope()
    scaling = {}
    if rope["rope_type"] == "llama3":
        scaling = dict(
            scaling="llama",
            scaling_factor=float(rope["factor"]),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        )
    elif rope["rope_type"] != "default":
        raise fields.fail("rope_type", rope["rope_type"], "is not a RoPE torchtitan's llama3 has")
    layers = llama3._build_llama3_layers(
        n_layers=fields.need("num_hidden_layers"),
        dim=dim,
        n_heads=n_heads,
        n_kv_heads=fields.get("num_key_value_heads", n_heads),
        hidden_dim=fields.need("intermediate_size"),
        rope=ComplexRoPE.Config(
            dim=dim // n_heads,
            max_seq_len=fields.need("max_position_embeddings"),
            theta=float(rope["rope_theta"]),
            **scaling,
        ),
        attn_backend=attn_backend,
    )
    init = (
        llama3._EMBEDDING_INIT,
        llama3._EMBEDDING_SKIP_INIT,
        llama3._NORM_INIT,
        llama3._output_linear_init(dim),
    )
    return _decoder(llama3.Llama3Model.Config, fields, layers, init)


def _qwen3(fields: Fields, attn_backend: str):
    """Qwen3ForCausalLM and Qwen3MoeForCausalLM (experts on every layer, softmax routing)."""
    from torchtitan.models import qwen3
    from torchtitan.models.common import CosSinRoPE

    _common(fields, "qwen3")
    fields.expect("use_sliding_window", (False,), "(sliding windows) is not in torchtitan's qwen3")
    if windowed := [kind for kind in fields.get("layer_types", []) if kind != "full_attention"]:
        raise fields.fail(
            "layer_types", windowed[0], "(a sliding window) is not in torchtitan's qwen3"
        )
    rope = fields.rope()
    if rope["rope_type"] != "default":
        raise fields.fail("rope_type", rope["rope_type"], "is not a RoPE torchtitan's qwen3 has")
    head_dim = fields.head_dim()
    sizes = dict(
        n_layers=fields.need("num_hidden_layers"),
        dim=fields.need("hidden_size"),
        n_heads=fields.need("num_attention_heads"),
        n_kv_heads=fields.need("num_key_value_heads"),
        head_dim=head_dim,
        attn_backend=attn_backend,
        rope=CosSinRoPE.Config(
            dim=head_dim,
            max_seq_len=fields.need("max_position_embeddings"),
            theta=float(rope["rope_theta"]),
        ),
    )
    # Qwen3-MoE's releases write num_experts; transformers 5 saves it as num_local_experts.
    experts = fields.get("num_experts", fields.get("num_local_experts"))
    if experts or fields.get("model_type") == "qwen3_moe":
        fields.expect("decoder_sparse_step", (1,), "(dense layers between MoE ones) is not read")
        fields.expect("mlp_only_layers", ([],), "(dense layers among MoE ones) is not read")
        fields.expect("shared_expert_intermediate_size", (0,), "(shared experts) is not read")
        layers = qwen3._build_qwen3_moe_layers(
            moe_hidden_dim=fields.need("moe_intermediate_size"),
            num_experts=experts or fields.need("num_experts"),
            top_k=fields.need("num_experts_per_tok"),
            moe_comm_backend="standard",
            **sizes,
        )
        for layer in layers:
            layer.moe.router.route_norm = bool(fields.get("norm_topk_prob", False))
    else:
        layers = qwen3._build_qwen3_layers(hidden_dim=fields.need("intermediate_size"), **sizes)
    init = (
        qwen3._EMBEDDING_INIT,
        qwen3._EMBEDDING_SKIP_INIT,
        qwen3._NORM_INIT,
        qwen3._LINEAR_INIT,
    )
    return _decoder(qwen3.Qwen3Model.Config, fields, layers, init)


def _gpt_oss(fields: Fields, attn_backend: str):
    """GptOssForCausalLM: sinks, biased attention, a sliding window on the layers
    `layer_types` says, YaRN RoPE, clamped-SwiGLU experts with biases, untied."""
    from torchtitan.models.common import CosSinRoPE

    from torchtitan_rl.models.tiny import gpt_oss_config

    fields.expect("attention_bias", (True,), "(unbiased attention) is not torchtitan's gpt_oss")
    fields.expect("tie_word_embeddings", (False,), "(tied embeddings) is not torchtitan's gpt_oss")
    rope = fields.rope()
    if rope["rope_type"] != "yarn":
        raise fields.fail("rope_type", rope["rope_type"], "is not the YaRN RoPE of gpt_oss")
    window = fields.get("sliding_window")
    kinds = fields.get("layer_types") or ["full_attention"] * fields.need("num_hidden_layers")
    if unknown := [kind for kind in kinds if kind not in ("sliding_attention", "full_attention")]:
        raise fields.fail("layer_types", unknown[0], "is not an attention gpt_oss has")
    config = gpt_oss_config(
        attn_backend,
        vocab_size=fields.need("vocab_size"),
        dim=fields.need("hidden_size"),
        n_heads=fields.need("num_attention_heads"),
        n_kv_heads=fields.need("num_key_value_heads"),
        head_dim=fields.head_dim(),
        windows=[window if kind == "sliding_attention" else None for kind in kinds],
        num_experts=fields.need("num_local_experts"),
        top_k=fields.get("num_experts_per_tok", fields.get("experts_per_token")),
        moe_hidden_dim=fields.need("intermediate_size"),
        swiglu_limit=float(fields.get("swiglu_limit", 7.0)),
        rope=CosSinRoPE.Config(
            dim=fields.head_dim(),
            max_seq_len=fields.need("max_position_embeddings"),
            theta=float(rope["rope_theta"]),
            scaling="yarn",
            rope_factor=float(rope["factor"]),
            beta_fast=float(rope.get("beta_fast", 32.0)),
            beta_slow=float(rope.get("beta_slow", 1.0)),
            truncate=bool(rope.get("truncate", True)),
            original_seq_len=int(rope["original_max_position_embeddings"]),
        ),
    )
    set_norm_eps(config, float(fields.get("rms_norm_eps", 1e-5)))
    return config


def _mla(fields: Fields, attn_backend: str, model_config, build_layers):
    """DeepseekV3ForCausalLM (DeepSeek-V3 and Kimi K2's text tower): multi-head latent
    attention, YaRN RoPE on interleaved pairs, dense layers first, then routed experts beside
    shared ones, "noaux_tc" routing (top-k of the scores plus the correction bias, within the
    `topk_group` best of `n_group` groups)."""
    from torchtitan.models.common import ComplexRoPE

    from torchtitan_rl.models.tiny import mla_config

    fields.expect("hidden_act", ("silu",), "is not the SiLU gate of torchtitan's MLA models")
    fields.expect("attention_bias", (False,), "(biased projections) is not in torchtitan's MLA")
    fields.expect("tie_word_embeddings", (False,), "(tied embeddings) is not torchtitan's MLA")
    fields.expect("topk_method", ("noaux_tc",), "is not the routing torchtitan's MLA models run")
    fields.expect("moe_layer_freq", (1,), "(dense layers among MoE ones) is not read")
    fields.expect("rope_interleave", (True,), "(RoPE on halves) is not torchtitan's MLA RoPE")
    rope = fields.rope()
    if rope["rope_type"] not in ("yarn", "default"):
        raise fields.fail("rope_type", rope["rope_type"], "is not a RoPE of torchtitan's MLA")
    mscale = float(rope.get("mscale_all_dim", 1.0) or 1.0)
    if float(rope.get("mscale", mscale)) != mscale:
        raise fields.fail(
            "rope_scaling.mscale", rope["mscale"], "differs from mscale_all_dim (not a rotation)"
        )
    scaling = {}
    if rope["rope_type"] == "yarn":
        scaling = dict(
            scaling="yarn",
            rope_factor=float(rope["factor"]),
            beta_fast=float(rope.get("beta_fast", 32.0)),
            beta_slow=float(rope.get("beta_slow", 1.0)),
            original_seq_len=int(rope["original_max_position_embeddings"]),
        )
    groups = fields.get("n_group", 1), fields.get("topk_group", 1)
    config = mla_config(
        attn_backend,
        model_config,
        build_layers,
        vocab_size=fields.need("vocab_size"),
        dim=fields.need("hidden_size"),
        n_layers=fields.need("num_hidden_layers"),
        n_dense_layers=fields.get("first_k_dense_replace", 0),
        n_heads=fields.need("num_attention_heads"),
        q_lora_rank=fields.get("q_lora_rank", 0),
        kv_lora_rank=fields.need("kv_lora_rank"),
        qk_nope_head_dim=fields.need("qk_nope_head_dim"),
        qk_rope_head_dim=fields.need("qk_rope_head_dim"),
        v_head_dim=fields.need("v_head_dim"),
        mscale=mscale,
        dense_hidden_dim=fields.need("intermediate_size"),
        moe_hidden_dim=fields.need("moe_intermediate_size"),
        num_experts=fields.need("n_routed_experts"),
        num_shared_experts=fields.get("n_shared_experts", 0),
        router_top_k=fields.need("num_experts_per_tok"),
        router_score_func=fields.get("scoring_func", "sigmoid"),
        router_num_expert_groups=None if groups == (1, 1) else groups[0],
        router_num_limited_groups=None if groups == (1, 1) else groups[1],
        router_route_scale=float(fields.get("routed_scaling_factor", 1.0)),
        router_route_norm=bool(fields.get("norm_topk_prob", False)),
        rope=ComplexRoPE.Config(
            dim=fields.need("qk_rope_head_dim"),
            max_seq_len=fields.need("max_position_embeddings"),
            theta=float(rope["rope_theta"]),
            **scaling,
        ),
    )
    set_norm_eps(config, float(fields.get("rms_norm_eps", 1e-6)))
    return config


def _deepseek_v3(fields: Fields, attn_backend: str):
    from torchtitan.models.deepseek_v3 import _build_dsv3_layers
    from torchtitan.models.deepseek_v3.model import DeepSeekV3Model

    return _mla(fields, attn_backend, DeepSeekV3Model.Config, _build_dsv3_layers)


def _kimi_k2_7(fields: Fields, attn_backend: str):
    from torchtitan.models.kimi_k2_7 import _build_kimi_layers
    from torchtitan.models.kimi_k2_7.model import KimiK25Model

    return _mla(fields, attn_backend, KimiK25Model.Config, _build_kimi_layers)


def _qwen3_5(fields: Fields, attn_backend: str):
    """Qwen3_5ForCausalLM and Qwen3_5MoeForCausalLM (text only): Gated DeltaNet layers with
    gated full attention every `full_attention_interval`-th layer (read from `layer_types`),
    partial RoPE, offset norms, untied; the MoE's experts beside a sigmoid-gated shared one."""
    from torchtitan_rl.models.qwen3_5 import family
    from torchtitan_rl.models.tiny import qwen3_5_text_config

    q35 = family()
    _common(fields, "qwen3_5")
    fields.expect("tie_word_embeddings", (False,), "(tied embeddings) is not torchtitan's qwen3_5")
    fields.expect("linear_conv_kernel_dim", (4,), "is not the width-4 convolution of qwen3_5")
    fields.expect("attn_output_gate", (True,), "(ungated attention) is not torchtitan's qwen3_5")
    n_layers = fields.need("num_hidden_layers")
    kinds = fields.need("layer_types")
    interval = kinds.index("full_attention") + 1 if "full_attention" in kinds else 0
    pattern = (
        [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(n_layers)
        ]
        if interval
        else []
    )
    if kinds != pattern:
        raise fields.fail(
            "layer_types", kinds, "is not full attention every k-th layer, as torchtitan builds"
        )
    rope = fields.rope()
    if rope["rope_type"] != "default":
        raise fields.fail("rope_type", rope["rope_type"], "is not a RoPE torchtitan's qwen3_5 has")
    if rope.get("mrope_interleaved", True) is not True:
        raise fields.fail(
            "rope_parameters.mrope_interleaved", False, "is not the interleaved MRoPE of qwen3_5"
        )
    head_dim = fields.head_dim()
    rotary_dim = int(head_dim * float(rope.get("partial_rotary_factor", 1.0)))
    sizes = dict(
        n_layers=n_layers,
        dim=fields.need("hidden_size"),
        n_heads=fields.need("num_attention_heads"),
        n_kv_heads=fields.need("num_key_value_heads"),
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        rope=q35.MRoPE.Config(
            dim=rotary_dim,
            max_seq_len=fields.need("max_position_embeddings"),
            theta=float(rope["rope_theta"]),
            mrope_section=list(rope.get("mrope_section", [rotary_dim // 2, 0, 0])),
        ),
        n_key_heads=fields.need("linear_num_key_heads"),
        n_value_heads=fields.need("linear_num_value_heads"),
        key_head_dim=fields.need("linear_key_head_dim"),
        value_head_dim=fields.need("linear_value_head_dim"),
        full_attention_interval=interval,
        attn_backend=attn_backend,
    )
    if fields.get("num_experts"):
        layers = q35._build_qwen35_moe_layers(
            moe_hidden_dim=fields.need("moe_intermediate_size"),
            num_experts=fields.need("num_experts"),
            top_k=fields.need("num_experts_per_tok"),
            shared_expert_hidden_dim=fields.need("shared_expert_intermediate_size"),
            **sizes,
        )
    else:
        layers = q35._build_qwen35_layers(hidden_dim=fields.need("intermediate_size"), **sizes)
    config = qwen3_5_text_config(fields.need("vocab_size"), sizes["dim"], layers)
    set_norm_eps(config, float(fields.get("rms_norm_eps", 1e-6)))
    return config


_READERS = {
    "llama3": _llama3,
    "qwen3": _qwen3,
    "gpt_oss": _gpt_oss,
    "deepseek_v3": _deepseek_v3,
    "kimi_k2_7": _kimi_k2_7,
    "qwen3_5": _qwen3_5,
    "muse_glimmer": muse_glimmer,
}


def read_architecture(folder: str | Path) -> str | None:
    """The first architecture config.json names (LlamaForCausalLM, ...), None without."""
    architectures = read_json(folder, "config.json", "model.hf_checkpoint").get("architectures")
    return architectures[0] if isinstance(architectures, list) and architectures else None
