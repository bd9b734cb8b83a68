"""Write the tiny, deterministic HF-format checkpoints that tests and the CPU demo use.

    .venv/bin/python scripts/make_tiny_checkpoint.py --out assets/tiny_qwen3

The weights come from torchtitan's own initialization of the `tiny` flavor of `--model`
(qwen3 or llama3; `tiny`, or the mixture-of-experts `tiny_moe` of qwen3:
`torchtitan_rl/models/tiny.py`) under a fixed seed, converted with the spec's
state-dict adapter (`to_hf`); the tokenizer is a character-level tokenizer trained locally with
`tokenizers` on the alphabet the built-in toy tasks need. Nothing is downloaded; the same seed
gives the same bytes.

`--mean_completion_tokens L` writes a variant whose sampled completions (temperature 1) end
after about L tokens on average, with a geometric tail, so that benchmarks of variable lengths
run both stacks on the same weights (scripts/bench/e2e.py):

    .venv/bin/python scripts/make_tiny_checkpoint.py --flavor debugmodel \
        --mean_completion_tokens 100 --out assets/debug_qwen3_L100

How: one residual dimension d is made a constant K (every token's embedding holds K there and
no layer writes to it), so the final norm gives every position nearly the same h_d; the stop
token's (`<|eos|>`: the tokenizer's eos, where TRL's generate stops, and a stop id of
generation_config.json, where vLLM stops) output row then gets an extra weight at d, which
raises its logit by the same amount everywhere. With the other logits near-uniform (random
init), the stop probability per token is about 1 / L; the extra weight is calibrated on
random token sequences. Sampled text is then near-uniform noise that stops at random: a
workload of lengths, not of meaning.
"""

import argparse
import json
import math
import string
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from torchtitan_rl import platform
from torchtitan_rl.models import model_spec

# DeepSeek-V3's architecture: Kimi K2's text tower is HF's DeepseekV3ForCausalLM too.
MLA_FAMILIES = ("deepseek_v3", "kimi_k2_7")
PAD, EOS, UNK = "<|pad|>", "<|eos|>", "<|unk|>"
# Qwen3's chat markers: the template below wraps each message in them, and a chat completion
# ends with IM_END (a stop id in generation_config.json, as in Qwen3's).
IM_START, IM_END, THINK, END_THINK = "<|im_start|>", "<|im_end|>", "<think>", "</think>"
SPECIAL_TOKENS = [PAD, EOS, UNK, IM_START, IM_END, THINK, END_THINK]
# Muse Glimmer's image markers (torchtitan_rl/vision/preprocess.py), in the vision flavors'
# tokenizers only: after the alphabet, so the text ids stay the text-only tokenizer's.
IMAGE_TOKENS = ["<|patch|>", "<|image_start|>", "<|image_end|>"]
# Qwen3's chat template reduced to what the tiny model needs: ChatML messages, the generation
# prompt, and enable_thinking = false's empty think block.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)
# The same for a vision-language model: a message's content may be a list of OpenAI-style parts,
# each image one `<|patch|>`, which the renderer expands to the image's placeholder run (as HF's
# MuseGlimmerProcessor does).
VISION_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(
    "message['content'] + '<|im_end|>\\n' }}",
    "'' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}"
    "{%- elif part['type'] in ('image', 'image_url') %}{{- '<|patch|>' }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}",
)
# The vision flavors' image processor (HF's MuseGlimmerImageProcessor's defaults but the size
# limit): an image gets at most 64 placeholder tokens, 8x8 cells of 28 pixels.
PREPROCESSOR = {
    "image_processor_type": "MuseGlimmerImageProcessor",
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "max_image_tokens": 64,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}
# Digits and words for the toy tasks, math punctuation for JSONL math prompts (\boxed{...}).
ALPHABET = string.digits + string.ascii_lowercase + " \n" + "+-*/=?:.,;!'\"()[]{}\\<>_"


def build_tokenizer(vocab_size: int, vision: bool = False) -> Tokenizer:
    """A character-level WordLevel tokenizer over ALPHABET, specials first (pad=0, eos=1);
    `vision`: Muse Glimmer's image markers after the alphabet."""
    extra = IMAGE_TOKENS if vision else []
    if len(SPECIAL_TOKENS) + len(ALPHABET) + len(extra) > vocab_size:
        raise SystemExit(f"vocab_size {vocab_size} is smaller than the tokenizer alphabet")
    tokenizer = Tokenizer(models.WordLevel(unk_token=UNK))
    # Every character is its own pre-token, so the vocabulary is exactly the alphabet.
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    trainer = trainers.WordLevelTrainer(
        vocab_size=vocab_size, min_frequency=1, special_tokens=SPECIAL_TOKENS
    )
    # Equal counts for every character: the trainer then orders them by character, stably.
    tokenizer.train_from_iterator([ALPHABET], trainer=trainer)
    tokenizer.add_special_tokens(extra)
    return tokenizer


def hf_config(name: str, model_config, eos_id: int, pad_id: int) -> dict:
    """HF `config.json` (Qwen3ForCausalLM, Qwen3MoeForCausalLM, LlamaForCausalLM or
    GptOssForCausalLM) with the shapes of the flavor."""
    if name == "qwen3_5":
        return _qwen3_5_config(model_config, eos_id, pad_id)
    layer = model_config.layers[0]
    attention = layer.attention
    rope = attention.rope
    if name in MLA_FAMILIES:
        return _deepseek_v3_config(model_config, eos_id, pad_id)
    if name == "muse_glimmer":
        return _muse_glimmer_config(model_config, eos_id, pad_id)
    n_heads, n_kv_heads = attention.n_heads, attention.n_kv_heads or attention.n_heads
    config = {
        "vocab_size": model_config.vocab_size,
        "hidden_size": model_config.dim,
        "intermediate_size": _ffn_width(layer),
        "num_hidden_layers": len(model_config.layers),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": attention.head_dim or model_config.dim // n_heads,
        "hidden_act": "silu",
        "max_position_embeddings": rope.max_seq_len,
        "rms_norm_eps": model_config.norm.eps,
        "rope_theta": float(rope.theta),
        "rope_scaling": None,
        **_common_fields(model_config, eos_id, pad_id),
    }
    if name == "gpt_oss":
        return _gpt_oss_config(model_config, config)
    if name == "qwen3" and layer.moe is not None:
        router = layer.moe.router
        return {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            **config,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": len(model_config.layers),
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "num_experts": router.num_experts,
            "num_experts_per_tok": router.top_k,
            "moe_intermediate_size": layer.moe.routed_experts.inner_experts.hidden_dim,
            "norm_topk_prob": router.route_norm,
            "output_router_logits": False,
            "router_aux_loss_coef": 0.001,
        }
    if name == "qwen3":
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            **config,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": len(model_config.layers),
        }
    # torchtitan's "llama" RoPE scaling is HF's "llama3" rope type with the same constants.
    config["rope_scaling"] = {
        "rope_type": "llama3",
        "factor": rope.scaling_factor,
        "low_freq_factor": rope.low_freq_factor,
        "high_freq_factor": rope.high_freq_factor,
        "original_max_position_embeddings": rope.original_max_position_embeddings,
    }
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **config,
        "mlp_bias": False,
    }


def _gpt_oss_config(model_config, config: dict) -> dict:
    """gpt-oss's config.json (as the released gpt-oss-20b's, unquantized): per-layer sliding
    windows, YaRN RoPE, biased attention, experts with a clamped SwiGLU."""
    layer = model_config.layers[0]
    rope, router = layer.attention.rope, layer.moe.router
    windows = {a.sliding_window_size for a in (x.attention for x in model_config.layers)}
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        **config,
        "attention_bias": True,
        "layer_types": [
            "sliding_attention" if x.attention.sliding_window_size else "full_attention"
            for x in model_config.layers
        ],
        "sliding_window": max(w for w in windows if w),
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": float(rope.rope_factor),
            "beta_fast": rope.beta_fast,
            "beta_slow": rope.beta_slow,
            "truncate": rope.truncate,
            "original_max_position_embeddings": rope.original_seq_len,
        },
        "initial_context_length": rope.original_seq_len,
        "num_local_experts": router.num_experts,
        "num_experts_per_tok": router.top_k,
        "experts_per_token": router.top_k,
        "swiglu_limit": layer.moe.routed_experts.inner_experts.swiglu_limit,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
    }


def _deepseek_v3_config(model_config, eos_id: int, pad_id: int) -> dict:
    """DeepSeek-V3's config.json (as the released DeepSeek-V3's): multi-head latent attention,
    YaRN RoPE on interleaved pairs with its attention scale (torchtitan's `mscale` is HF's
    `mscale_all_dim`; `mscale` equal to it keeps the rotation a pure rotation, as torchtitan's),
    dense layers first, then sigmoid routing ("noaux_tc": top-k of the scores plus the
    correction bias, within the `topk_group` best of `n_group` groups) beside shared experts."""
    attention = model_config.layers[0].attention
    rope = attention.rope
    moe_layers = [layer for layer in model_config.layers if layer.moe is not None]
    moe = moe_layers[0].moe
    router, experts = moe.router, moe.routed_experts.inner_experts
    dense = model_config.layers[0].feed_forward
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": model_config.vocab_size,
        "hidden_size": model_config.dim,
        "intermediate_size": dense.w1.out_features,
        "moe_intermediate_size": experts.hidden_dim,
        "num_hidden_layers": len(model_config.layers),
        "num_attention_heads": attention.n_heads,
        "num_key_value_heads": attention.n_heads,
        "q_lora_rank": attention.q_lora_rank or None,
        "kv_lora_rank": attention.kv_lora_rank,
        "qk_nope_head_dim": attention.qk_nope_head_dim,
        "qk_rope_head_dim": attention.qk_rope_head_dim,
        "v_head_dim": attention.v_head_dim,
        "n_shared_experts": moe.shared_experts.w1.out_features // experts.hidden_dim,
        "n_routed_experts": router.num_experts,
        "num_experts_per_tok": router.top_k,
        "routed_scaling_factor": router.route_scale,
        "norm_topk_prob": router.route_norm,
        "scoring_func": router.score_func,
        "topk_method": "noaux_tc",
        "n_group": router.num_expert_groups or 1,
        "topk_group": router.num_limited_groups or 1,
        "first_k_dense_replace": len(model_config.layers) - len(moe_layers),
        "moe_layer_freq": 1,
        "hidden_act": "silu",
        "max_position_embeddings": rope.max_seq_len,
        "rms_norm_eps": model_config.norm.eps,
        "rope_theta": float(rope.theta),
        "rope_scaling": {
            "type": "yarn",
            "rope_type": "yarn",
            "factor": float(rope.rope_factor),
            "original_max_position_embeddings": rope.original_seq_len,
            "beta_fast": float(rope.beta_fast),
            "beta_slow": float(rope.beta_slow),
            "mscale": float(attention.mscale),
            "mscale_all_dim": float(attention.mscale),
        },
        "rope_interleave": True,
        **_common_fields(model_config, eos_id, pad_id),
    }


def _muse_glimmer_config(model_config, eos_id: int, pad_id: int) -> dict:
    """Muse Glimmer's config.json, as the released checkpoints' (a vision-language model: the
    text tower's fields under `text_config`), for the text tower alone:
    - `has_vision: false` tells vLLM to build no vision tower. HF's class always builds one, of
      `vision_config`'s size: a 1-layer one here, which its loader leaves at its initial values
      (the text tower's logits do not read it).
    - `qk_scale_factor` is HF's (the query scale after QK-norm, 1 / sqrt(head_dim) folded in);
      vLLM takes a value above sqrt(head_dim) for the unfolded one (true at 30B's head_dim,
      not at the tiny's), so `scale_query_by`, which vLLM reads first, states it outright."""
    layers = model_config.layers
    attention = layers[0].attention
    window = next(layer.attention.window_size for layer in layers if layer.attention.window_size)
    text = {
        "model_type": "muse_glimmer_text",
        "vocab_size": model_config.vocab_size,
        "hidden_size": model_config.dim,
        "intermediate_size": _ffn_width(layers[0]),
        "num_hidden_layers": len(layers),
        "num_attention_heads": attention.n_heads,
        "num_key_value_heads": attention.n_kv_heads,
        "head_dim": attention.head_dim,
        "hidden_activation": "silu",
        "max_position_embeddings": attention.rope.max_seq_len,
        "rms_norm_eps": layers[0].attention_norm.eps,
        "post_norm_eps": layers[0].post_attention_norm.eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": float(attention.rope.theta)},
        "sliding_window": window,
        "layer_types": [
            "sliding_attention" if layer.attention.window_size else "full_attention"
            for layer in layers
        ],
        "layer_rope_theta": [
            float(attention.rope.theta) if layer.attention.use_rope else 0 for layer in layers
        ],
        "no_rope_layers": [int(layer.attention.use_rope) for layer in layers],
        "qk_scale_factor": attention.scale_query_by,
        "scale_query_by": attention.scale_query_by,
        "output_multiplier": model_config.lm_head.output_multiplier,
        "final_logit_softcapping": model_config.lm_head.output_soft_cap_temp,
        **_common_fields(model_config, eos_id, pad_id),
    }
    encoder = model_config.vision_encoder
    if encoder is None:
        vision = {
            "model_type": "muse_glimmer_vision",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_attention_heads": 2,
            "num_hidden_layers": 1,
            "pos_emb_height": 2,
            "pos_emb_width": 2,
        }
    else:
        vision = {
            "model_type": "muse_glimmer_vision",
            "hidden_size": encoder.latent_dim,
            "intermediate_size": encoder.block.mlp.fc1.out_features,
            "num_attention_heads": encoder.num_heads,
            "num_hidden_layers": encoder.num_layers,
            "pos_emb_height": encoder.pos_emb_grid_h,
            "pos_emb_width": encoder.pos_emb_grid_w,
            "max_position_embeddings": encoder.pos_emb_grid_h * encoder.pos_emb_grid_w,
            "patch_size": encoder.patch_size,
            "patch_temporal": encoder.patch_temporal,
            "merge_size": encoder.downsample_factor,
            "rope_parameters": {
                "rope_type": "axial",
                "rope_theta": float(encoder.rope_freq.rope_theta),
            },
        }
    config = {
        "architectures": ["MuseGlimmerForConditionalGeneration"],
        "model_type": "muse_glimmer",
        "has_vision": encoder is not None,
        "text_config": text,
        "vision_config": vision,
        "out_hidden_size": vision["hidden_size"] * 4,
        "projector_hidden_size": 64,
        **_common_fields(model_config, eos_id, pad_id),
    }
    if encoder is not None:
        config["out_hidden_size"] = encoder.output_dim
        config["projector_hidden_size"] = model_config.vision_projection.in_features
    return config


def _qwen3_5_config(model_config, eos_id: int, pad_id: int) -> dict:
    """Qwen3.5's text-only config.json (`Qwen3_5ForCausalLM`, `Qwen3_5MoeForCausalLM`): the
    layer kinds in `layer_types`, the Gated DeltaNet sizes in `linear_*`, RoPE on
    `partial_rotary_factor` of each full-attention head (MRoPE's sections, which text-only
    positions make equivalent to plain RoPE)."""
    layers = model_config.layers
    attention = next(layer.attention for layer in layers if layer.attention is not None)
    delta_net = next(layer.delta_net for layer in layers if layer.delta_net is not None)
    rope = attention.rope
    moe = layers[0].moe
    config = {
        "vocab_size": model_config.vocab_size,
        "hidden_size": model_config.dim,
        "num_hidden_layers": len(layers),
        "num_attention_heads": attention.n_heads,
        "num_key_value_heads": attention.n_kv_heads,
        "head_dim": attention.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": rope.max_seq_len,
        "rms_norm_eps": model_config.norm.eps,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": float(rope.theta),
            "partial_rotary_factor": attention.rotary_dim / attention.head_dim,
            "mrope_section": list(rope.mrope_section),
            "mrope_interleaved": True,
        },
        "layer_types": [
            "full_attention" if layer.attention is not None else "linear_attention"
            for layer in layers
        ],
        "linear_conv_kernel_dim": delta_net.conv_kernel_size,
        "linear_key_head_dim": delta_net.key_head_dim,
        "linear_value_head_dim": delta_net.value_head_dim,
        "linear_num_key_heads": delta_net.in_proj_q.out_features // delta_net.key_head_dim,
        "linear_num_value_heads": delta_net.in_proj_v.out_features // delta_net.value_head_dim,
        **_common_fields(model_config, eos_id, pad_id),
    }
    if moe is None:
        return {
            "architectures": ["Qwen3_5ForCausalLM"],
            "model_type": "qwen3_5_text",
            "intermediate_size": layers[0].feed_forward.w1.out_features,
            **config,
        }
    return {
        "architectures": ["Qwen3_5MoeForCausalLM"],
        "model_type": "qwen3_5_moe_text",
        "moe_intermediate_size": moe.routed_experts.inner_experts.hidden_dim,
        "shared_expert_intermediate_size": moe.shared_experts.w1.out_features,
        "num_experts": moe.router.num_experts,
        "num_experts_per_tok": moe.router.top_k,
        "router_aux_loss_coef": 0.001,
        "output_router_logits": False,
        **config,
    }


def _common_fields(model_config, eos_id: int, pad_id: int) -> dict:
    """The config.json fields every family's checkpoint writes alike."""
    return {
        "tie_word_embeddings": model_config.enable_weight_tying,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "torch_dtype": "float32",
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "use_cache": True,
    }


def _ffn_width(layer) -> int:
    """A layer's MLP width; an MoE layer's, each expert's (HF's dense `intermediate_size` is
    then unused, as every Qwen3-MoE layer is sparse)."""
    if getattr(layer, "moe", None) is not None:
        return layer.moe.routed_experts.inner_experts.hidden_dim
    return layer.feed_forward.w1.out_features


def mtp_layer(hf_state: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """A multi-token-prediction layer as DeepSeek-V3's checkpoints store theirs, the decoder
    layer right past the model's (`model.layers.{num_hidden_layers}`): the last layer's tensors
    plus its embedding norms, projection and head norm. The model, trained and served without
    it (trainer/model.py `is_unread_key`, vLLM's loader), leaves it unread."""
    last, mtp = config["num_hidden_layers"] - 1, config["num_hidden_layers"]
    dim = config["hidden_size"]
    layer = {
        name.replace(f"model.layers.{last}.", f"model.layers.{mtp}."): tensor.clone()
        for name, tensor in hf_state.items()
        if name.startswith(f"model.layers.{last}.")
    }
    extra = {"enorm": torch.ones(dim), "hnorm": torch.ones(dim)}
    extra |= {"eh_proj": torch.zeros(dim, 2 * dim), "shared_head.norm": torch.ones(dim)}
    return layer | {f"model.layers.{mtp}.{name}.weight": value for name, value in extra.items()}


def raise_stop_logit(model, stop_id: int, mean_tokens: int, seed: int) -> float:
    """Make `model` (torchtitan, random init) stop after about `mean_tokens` sampled tokens on
    average (module docstring); returns the calibrated stop probability per token."""
    import torch.nn.functional as F

    state = model.state_dict(keep_vars=True)
    dim = model.tok_embeddings.weight.shape[1]
    d, level = dim - 1, 50 * float(model.tok_embeddings.weight.detach().std())
    with torch.no_grad():
        model.tok_embeddings.weight[:, d] = level  # tied: every logit shifts alike
        for name, weight in state.items():
            if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
                weight[d] = 0.0  # no layer writes to d
            elif name.endswith("inner_experts.w2_EDF"):
                weight[:, d] = 0.0  # nor any expert
        head = model.lm_head.weight
        g = torch.Generator().manual_seed(seed)
        tokens_BT = torch.randint(0, head.shape[0], (8, 128), generator=g)
        positions_BT = torch.arange(128).expand(8, 128)
        target = math.log(1.0 / mean_tokens)
        for _ in range(4):  # Newton-like steps on log p(stop): it moves by h_d per unit of weight
            model._skip_lm_head = True
            hidden_BTD = model(tokens_BT, positions=positions_BT)
            model._skip_lm_head = False
            logp_stop = F.log_softmax(F.linear(hidden_BTD, head), -1)[..., stop_id]
            p_stop = float(logp_stop.exp().mean())
            head[stop_id, d] += (target - math.log(p_stop)) / float(hidden_BTD[..., d].mean())
    return p_stop


def unit_gain_vision_projection(model) -> None:
    """Draw the vision adapter's and projection's weights at unit gain (std 1 / sqrt(fan_in)),
    as a trained model's carry its features. torchtitan's init (std 0.02) shrinks the random
    tower's features to about 1e-3 before the projection's scaleless norm, which then scales
    their gradients up about 1000 times, and gradient clipping (training.max_grad_norm) then all
    but stops every update. The vision demo's SFT (colour questions, steps of 16) stays at
    chance at std 0.02 (held-out 0.30 at step 200) and reads colours at unit gain (0.545 at
    step 300: docs/vision.md#the-demo)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.startswith(("vision_adapter.", "vision_projection.")) and param.dim() == 2:
                param.normal_(0.0, param.shape[1] ** -0.5)


def write_checkpoint(
    out: Path, seed: int = 0, name: str = "qwen3", flavor: str = "tiny", mean_tokens: int = 0
) -> None:
    """Write config.json, generation_config.json (stop ids: <|im_end|> and <|eos|>, as Qwen3
    lists two), model.safetensors, tokenizer.json, tokenizer_config.json (with the chat
    template) to `out`.

    torchtitan.json records the torchtitan model name and flavor the weights belong to.
    """
    spec = model_spec(name, flavor)
    if mean_tokens:
        platform.use_platform_attention(spec.model)  # calibration runs it (no parameters)
    vision = getattr(spec.model, "vision_encoder", None) is not None
    tokenizer = build_tokenizer(spec.model.vocab_size, vision)
    eos_id, pad_id = tokenizer.token_to_id(EOS), tokenizer.token_to_id(PAD)
    im_end_id = tokenizer.token_to_id(IM_END)

    torch.manual_seed(seed)
    model = spec.model.build()
    model.init_states()
    if name in MLA_FAMILIES:  # a correction bias that routes, as a trained checkpoint's
        for buffer_name, buffer in model.named_buffers():
            if buffer_name.endswith("moe.expert_bias_E"):
                buffer.normal_(0.0, 0.05)
    for module in model.modules():  # gains off their centre (init: the centre), as trained
        centre = getattr(module, "gain_center", None)
        if name == "qwen3_5" and hasattr(module, "eps"):  # (1 + w) norms, the gated norm's w
            centre = 1.0 if type(module).__name__ == "OffsetRMSNorm" else 0.0
        if centre is not None:
            with torch.no_grad():
                module.weight.normal_(1.0 - centre, 0.1)
    if vision:
        unit_gain_vision_projection(model)
    if mean_tokens:
        p_stop = raise_stop_logit(model, eos_id, mean_tokens, seed)
        print(f"stop probability per token: {p_stop:.5f} (1 / {1 / p_stop:.1f})")
    adapter = spec.state_dict_adapter(spec.model, None)
    hf_state = {k: v.detach().contiguous() for k, v in adapter.to_hf(model.state_dict()).items()}
    config = hf_config(name, spec.model, eos_id, pad_id)
    if vision:
        config["image_token_id"] = tokenizer.token_to_id(IMAGE_TOKENS[0])
    if (name, flavor) == ("deepseek_v3", "tiny"):
        hf_state |= mtp_layer(hf_state, config)
        config["num_nextn_predict_layers"] = 1

    out.mkdir(parents=True, exist_ok=True)
    save_file(hf_state, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [im_end_id, eos_id], "pad_token_id": pad_id}, indent=2) + "\n"
    )
    (out / "torchtitan.json").write_text(json.dumps({"name": name, "flavor": flavor}) + "\n")
    tokenizer.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": UNK,
        "model_max_length": config.get("text_config", config)["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "chat_template": VISION_CHAT_TEMPLATE if vision else CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    if vision:
        (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("assets/tiny_qwen3"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--model",
        default="qwen3",
        choices=["qwen3", "llama3", "gpt_oss", *MLA_FAMILIES, "muse_glimmer", "qwen3_5"],
    )
    parser.add_argument(
        "--flavor",
        default="tiny",
        help="tiny or tiny_moe (tests and the demos), debugmodel[_moe] (benchmarks); gpt_oss: tiny",
    )
    parser.add_argument(
        "--mean_completion_tokens",
        type=int,
        default=0,
        help="write a variant whose sampled completions end after about this many tokens",
    )
    args = parser.parse_args()
    write_checkpoint(args.out, args.seed, args.model, args.flavor, args.mean_completion_tokens)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
