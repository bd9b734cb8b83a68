"""Muse Glimmer's config.json read into torchtitan's model config (`model.flavor = "auto"`).

    .venv/bin/python -m pytest tests/unit/test_from_hf.py -k muse_glimmer

A `MuseGlimmerForConditionalGeneration` checkpoint holds the text tower's fields under
`text_config` and the vision tower's under `vision_config`; `has_vision: false` (which vLLM
reads too) says the checkpoint is the text tower alone. torchtitan's builder fixes what
transformers' class reads from the file (the FFN width 3 x dim, one norm eps, the query scale
43.78 / sqrt(head_dim), RoPE on all but every fourth layer from the last, a cap of 20): each is
set here from the file, layer by layer where the file says per layer.
"""

import dataclasses

from torchtitan_rl.models.hf_fields import Fields, set_norm_eps


def muse_glimmer(fields: Fields, attn_backend: str):
    """The text tower (and the vision tower, unless `has_vision` is false) of `fields`."""
    from torchtitan.models import muse_glimmer as mg

    text = fields.section("text_config")
    vision = None
    if fields.get("has_vision", True):
        vision = _vision(fields, fields.section("vision_config"))
    dim, n_layers = text.need("hidden_size"), text.need("num_hidden_layers")
    text.expect("hidden_activation", ("silu",), "is not the SiLU gate of Muse Glimmer's FFN")
    text.expect("attention_bias", (False,), "(biased projections) is not in Muse Glimmer")
    text.expect("tie_word_embeddings", (False,), "(tied embeddings) is not in Muse Glimmer")
    rope = text.rope()
    if rope["rope_type"] != "default":
        raise text.fail("rope_type", rope["rope_type"], "is not Muse Glimmer's RoPE")
    theta = float(rope["rope_theta"])
    # transformers' defaults: every fourth layer from the last global and without RoPE.
    every_fourth = [(n_layers - 1 - i) % 4 == 0 for i in range(n_layers)]
    kinds = text.get("layer_types") or [
        "full_attention" if nope else "sliding_attention" for nope in every_fourth
    ]
    if unknown := [kind for kind in kinds if kind not in ("sliding_attention", "full_attention")]:
        raise text.fail("layer_types", unknown[0], "is not an attention Muse Glimmer has")
    window = text.get("sliding_window") if "sliding_attention" in kinds else 0
    if "sliding_attention" in kinds and not window:
        raise text.fail("sliding_window", window, "leaves the sliding layers without a window")
    thetas = text.get("layer_rope_theta") or [0 if nope else theta for nope in every_fourth]
    if odd := [t for t in thetas if t not in (0, theta)]:
        raise text.fail("layer_rope_theta", odd[0], f"differs from rope_theta ({theta:g})")
    use_rope = [bool(t) for t in thetas]
    if text.get("no_rope_layers") not in (None, [int(u) for u in use_rope]):
        raise text.fail(
            "no_rope_layers", text.get("no_rope_layers"), "contradicts layer_rope_theta"
        )
    scale = float(text.need("qk_scale_factor"))
    if text.get("scale_query_by") not in (None, scale):
        raise text.fail(
            "scale_query_by", text.get("scale_query_by"), "differs from qk_scale_factor"
        )
    head_dim = text.head_dim()
    adapter_dim = fields.need("projector_hidden_size") if vision else None
    config = mg._muse_glimmer_config(
        dim=dim,
        n_layers=n_layers,
        n_heads=text.need("num_attention_heads"),
        n_kv_heads=text.need("num_key_value_heads"),
        head_dim=head_dim,
        vocab_size=text.need("vocab_size"),
        max_seq_len=text.need("max_position_embeddings"),
        window_pattern=[0],
        output_multiplier=float(text.need("output_multiplier")),
        attn_backend=attn_backend,
        vision_adapter_dim=adapter_dim,
        vision_encoder=vision[0] if vision else None,
        vision_adapter=vision[1] if vision else None,
    )
    config.lm_head = dataclasses.replace(
        config.lm_head, output_soft_cap_temp=float(text.need("final_logit_softcapping"))
    )
    hidden_dim = text.need("intermediate_size")
    for layer_id, (layer, kind) in enumerate(zip(config.layers, kinds, strict=True)):
        # One layer's attention as torchtitan builds it for a window of its own (a pattern of
        # one), then the file's RoPE switch and query scale.
        layer.attention = mg._build_muse_glimmer_attention(
            layer_id=layer_id,
            n_layers=n_layers,
            dim=dim,
            n_heads=layer.attention.n_heads,
            n_kv_heads=layer.attention.n_kv_heads,
            head_dim=head_dim,
            max_seq_len=layer.attention.rope.max_seq_len,
            window_pattern=[window if kind == "sliding_attention" else 0],
            attn_backend=attn_backend,
        )
        layer.attention.use_rope = use_rope[layer_id]
        layer.attention.scale_query_by = scale
        layer.attention.rope = dataclasses.replace(layer.attention.rope, theta=theta)
        layer.feed_forward = mg.make_ffn_config(
            dim=dim,
            hidden_dim=hidden_dim,
            w1_param_init=mg._LINEAR_INIT,
            w2w3_param_init=mg._depth_init(layer_id),
        )
    # transformers: rms_norm_eps everywhere in the text tower but the post-norms.
    set_norm_eps(config, float(text.get("rms_norm_eps", 1e-5)))
    post_norm_eps = float(text.get("post_norm_eps", 1e-8))
    for layer in config.layers:
        layer.post_attention_norm.eps = layer.post_ffn_norm.eps = post_norm_eps
    return config


def _vision(fields: Fields, vision: Fields):
    """The vision encoder's and adapter's configs of `vision_config` and the projector fields."""
    from torchtitan.models import muse_glimmer as mg

    fields.expect("projector_hidden_act", ("gelu",), "is not the GELU of Muse Glimmer's adapter")
    vision.expect("hidden_act", ("gelu",), "is not the GELU of Muse Glimmer's vision MLP")
    rope = vision.get("rope_parameters", {})
    if rope.get("rope_type", "axial") != "axial":
        raise vision.fail("rope_parameters.rope_type", rope["rope_type"], "is not axial RoPE")
    latent, n_layers = vision.get("hidden_size", 1536), vision.get("num_hidden_layers", 50)
    kinds = vision.get("layer_types") or _vision_kinds(n_layers, 4)
    # torchtitan attends globally on the last layer and every factor-th one (4 by default).
    factor = next(
        (f for f in (4, *range(1, n_layers + 2)) if kinds == _vision_kinds(n_layers, f)), None
    )
    if factor is None:
        raise vision.fail(
            "layer_types", kinds, "is not global attention every k-th and the last layer"
        )
    merge = vision.get("merge_size", 2)
    encoder = mg.muse_glimmer_vision_encoder_config(
        latent_dim=latent,
        num_layers=n_layers,
        num_heads=vision.get("num_attention_heads", 16),
        patch_size=vision.get("patch_size", 14),
        patch_temporal=vision.get("patch_temporal", 2),
        downsample_factor=merge,
        sparse_attention_factor=factor,
        pos_emb_grid_h=vision.get("pos_emb_height", 32),
        pos_emb_grid_w=vision.get("pos_emb_width", 32),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
    )
    hidden = vision.get("intermediate_size", 8960)
    mlp = encoder.block.mlp
    encoder.block.mlp = dataclasses.replace(
        mlp,
        fc1=dataclasses.replace(mlp.fc1, out_features=hidden),
        fc2=dataclasses.replace(mlp.fc2, in_features=hidden),
    )
    for norm in (encoder.ln_pre, encoder.ln_post):  # transformers: the blocks' stay 1e-5
        norm.eps = float(vision.get("layer_norm_eps", 1e-5))
    if fields.get("out_hidden_size", encoder.output_dim) != encoder.output_dim:
        raise fields.fail(
            "out_hidden_size",
            fields.get("out_hidden_size"),
            f"is not vision_config's hidden_size x merge_size^2 ({encoder.output_dim})",
        )
    adapter = mg.muse_glimmer_vision_adapter_config(
        input_dim=encoder.output_dim, output_dim=fields.need("projector_hidden_size")
    )
    return encoder, adapter


def _vision_kinds(n_layers: int, factor: int) -> list[str]:
    """The vision layers' attention kinds when every `factor`-th and the last are global."""
    return [
        "full_attention" if (i + 1) % factor == 0 or i == n_layers - 1 else "window_attention"
        for i in range(n_layers)
    ]
