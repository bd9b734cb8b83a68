"""model.flavor = "auto": the torchtitan config read from an HF checkpoint's config.json.

    .venv/bin/python -m pytest tests/unit/test_from_hf.py

Checkpoints of shapes no torchtitan flavor has are made here with transformers' own classes
(random init, saved with save_pretrained) and the tiny tokenizer, so the reference is the
architecture's own implementation, not this project's writer of config.json.
"""

import dataclasses
import json
import shutil

import pytest
import torch
from helpers.launch import REPO
from helpers.titan import torchtitan_model

from torchtitan_rl.config import ConfigError, ModelSection
from torchtitan_rl.models import FAMILIES, _config, flavors, from_hf, model_spec

TOKENIZER = REPO / "assets" / "tiny_qwen3"
IDS = [5, 17, 33, 2, 60, 41, 9, 12, 30, 30, 7, 44, 61, 3, 25, 18, 50, 11, 6, 39]


def leaves(config, path=""):
    """(dotted path, value) of every value in a config tree but the initializers."""
    if isinstance(config, list):
        for i, item in enumerate(config):
            yield from leaves(item, f"{path}[{i}]")
    elif dataclasses.is_dataclass(config):
        for field in dataclasses.fields(config):
            if field.name != "param_init":
                yield from leaves(getattr(config, field.name), f"{path}.{field.name}")
    elif not callable(config):
        yield path, config


@pytest.mark.parametrize(
    ("name", "flavor", "folder"),
    [
        ("qwen3", "tiny", "tiny_qwen3"),
        ("qwen3", "tiny_moe", "tiny_moe_qwen3"),
        ("llama3", "tiny", "tiny_llama3"),
        ("gpt_oss", "tiny", "tiny_gpt_oss"),
        ("deepseek_v3", "tiny", "tiny_deepseek_v3"),
        ("deepseek_v3", "tiny_grouped", "tiny_grouped_deepseek_v3"),
        ("kimi_k2_7", "tiny", "tiny_kimi_k2_7"),
        ("qwen3_5", "tiny", "tiny_qwen3_5"),
        ("qwen3_5", "tiny_moe", "tiny_moe_qwen3_5"),
        ("muse_glimmer", "tiny", "tiny_muse_glimmer"),
        ("muse_glimmer", "tiny_vl", "tiny_vl_muse_glimmer"),
    ],
)
def test_the_tiny_checkpoints_config_json_gives_their_flavor(name, flavor, folder):
    """Every value of the config read from config.json (written from the named flavor by
    make_tiny_checkpoint.py) equals the named flavor's: sizes, RoPE and its scaling, norm eps,
    tying, routing, windows, sinks."""
    named = dict(leaves(_config(name, flavor)))
    derived = dict(leaves(_config(name, from_hf.derived_flavor(str(REPO / "assets" / folder)))))
    assert len(named) > 100
    assert derived == named


def _save(model, folder, tokenizer=TOKENIZER, files=("tokenizer.json", "tokenizer_config.json")):
    model.save_pretrained(folder)
    for file in files:
        shutil.copyfile(tokenizer / file, folder / file)
    return folder


def llama(folder, **overrides):
    """A LlamaForCausalLM at a shape no llama3 flavor has (SmolLM2's proportions)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = dict(
        vocab_size=68,
        hidden_size=96,
        intermediate_size=200,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        initializer_range=0.2,
    )
    return _save(LlamaForCausalLM(LlamaConfig(**{**config, **overrides})), folder)


def qwen3(folder, **overrides):
    """A Qwen3ForCausalLM, untied, whose head_dim is not hidden_size / heads."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = dict(
        vocab_size=68,
        hidden_size=80,
        intermediate_size=144,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=20000.0,
        tie_word_embeddings=False,
        initializer_range=0.2,
    )
    return _save(Qwen3ForCausalLM(Qwen3Config(**{**config, **overrides})), folder)


def qwen3_moe(folder):
    """A Qwen3MoeForCausalLM: 6 experts of width 40, top 3, not renormalized."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=68,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=40,
        num_experts=6,
        num_experts_per_tok=3,
        norm_topk_prob=False,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        initializer_range=0.2,
    )
    return _save(Qwen3MoeForCausalLM(config), folder)


def deepseek_v3(folder):
    """A DeepseekV3ForCausalLM without a query LoRA (q_lora_rank null: DeepSeek-V2-Lite's
    shape), 4 experts of width 24 beside 2 shared ones, plain RoPE."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    config = DeepseekV3Config(
        vocab_size=68,
        hidden_size=64,
        intermediate_size=112,
        moe_intermediate_size=24,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=None,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        n_shared_experts=2,
        n_routed_experts=4,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=1.5,
        rope_interleave=True,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        initializer_range=0.2,
    )
    model = DeepseekV3ForCausalLM(config)
    for layer in model.model.layers[1:]:  # a correction bias that routes
        layer.mlp.gate.e_score_correction_bias.normal_(0, 0.5)
    return _save(model, folder)


def qwen3_5(folder, moe: bool = False):
    """A Qwen3_5ForCausalLM (or its MoE) at a shape no qwen3_5 flavor has: full attention every
    2nd layer, half the head rotated, 2 key heads repeated to 4 value heads of 32; the MoE 6
    experts of width 40, top 2, beside a shared one of 48. Norm weights drawn (HF's offset
    norms start at 0)."""
    import transformers

    torch.manual_seed(0)
    config = dict(
        vocab_size=68,
        hidden_size=96,
        intermediate_size=160,
        num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention"] * 2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1e6,
            "partial_rotary_factor": 0.5,
            "mrope_section": [2, 2, 2],
            "mrope_interleaved": True,
        },
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        initializer_range=0.2,
    )
    if moe:
        config |= dict(
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=40,
            shared_expert_intermediate_size=48,
        )
        model = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**config))
    else:
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**config))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(0, 0.3)
    return _save(model, folder)


def muse_glimmer(folder):
    """A MuseGlimmerForConditionalGeneration at a shape no muse_glimmer flavor has: 5 text layers
    (global and without RoPE at the first and the last, a 12-token window on the others), an FFN
    of 200 (not 3 x 64), a query scale of 5, norm eps 1e-3 and post-norm eps 0.05 (large enough
    to move a logit), a cap of 8; a
    vision tower of 3 layers of width 48 (3 heads, MLP 72), windowed on its first only, 3x3
    learned positions, layer-norm eps 0.1, the adapter to 40. Norm gains drawn (HF's centred
    norms start at 0). The tiny vision-language tokenizer and image processor."""
    from transformers import MuseGlimmerConfig, MuseGlimmerForConditionalGeneration

    torch.manual_seed(0)
    config = MuseGlimmerConfig(
        text_config=dict(
            vocab_size=72,
            hidden_size=64,
            intermediate_size=200,
            num_hidden_layers=5,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=512,
            rms_norm_eps=1e-3,
            post_norm_eps=0.05,
            rope_parameters={"rope_type": "default", "rope_theta": 20000.0},
            sliding_window=12,
            qk_scale_factor=5.0,
            output_multiplier=1.5,
            final_logit_softcapping=8.0,
            initializer_range=0.2,
        ),
        vision_config=dict(
            hidden_size=48,
            intermediate_size=72,
            num_attention_heads=3,
            num_hidden_layers=3,
            pos_emb_height=3,
            pos_emb_width=3,
            max_position_embeddings=9,
            layer_norm_eps=0.1,
            layer_types=["window_attention", "full_attention", "full_attention"],
            rope_parameters={"rope_type": "axial", "rope_theta": 10000.0},
        ),
        out_hidden_size=48 * 4,
        projector_hidden_size=40,
        image_token_id=68,
        initializer_range=0.2,
    )
    model = MuseGlimmerForConditionalGeneration(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.normal_(0, 0.3)
    files = ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json")
    return _save(model, folder, REPO / "assets" / "tiny_vl_muse_glimmer", files)


MAKERS = {
    "llama3": llama,
    "llama3 (Llama 3.1 RoPE, untied)": lambda folder: llama(
        folder,
        tie_word_embeddings=False,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    "qwen3": qwen3,
    "qwen3 (MoE)": qwen3_moe,
    "deepseek_v3": deepseek_v3,
    "qwen3_5": qwen3_5,
    "qwen3_5 (MoE)": lambda folder: qwen3_5(folder, moe=True),
    "muse_glimmer": muse_glimmer,
}


@pytest.mark.parametrize("case", MAKERS)
def test_an_unregistered_shape_gives_transformers_logits_and_exports_itself(case, tmp_path):
    """A checkpoint of a shape no registered flavor has trains under model.flavor = "auto":
    torchtitan's model built from its config.json has transformers' logits (fp32, 20 tokens:
    the scaled RoPE's 16-token original context is crossed), and the HF export of the loaded
    weights is the checkpoint's tensors, bit for bit."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from torchtitan_rl.hf_export import export_hf

    name = case.split()[0]
    folder = MAKERS[case](tmp_path / "ckpt")
    model_section = ModelSection(name=name, hf_checkpoint=str(folder))
    assert model_section.flavor == f"auto:{folder}"
    model_section.validate()
    shapes = {
        k: v.shape
        for k, v in model_spec(name, model_section.flavor).model.build().state_dict().items()
    }
    for flavor in flavors(name):  # no registered flavor has this shape
        with torch.device("meta"):
            named = model_spec(name, flavor).model.build().state_dict()
        assert {k: v.shape for k, v in named.items()} != shapes

    auto = AutoModelForImageTextToText if name == "muse_glimmer" else AutoModelForCausalLM
    hf = auto.from_pretrained(folder, attn_implementation="eager")
    with torch.no_grad():
        expected = hf(torch.tensor([IDS])).logits[0]
    model = torchtitan_model(str(folder), model_section.flavor, name)
    with torch.no_grad():
        logits = model(torch.tensor([IDS]), positions=torch.arange(len(IDS))[None])[0]
    assert expected.std() > 0.1
    bound = 1e-4 if name == "muse_glimmer" else 1e-5  # test_tiny_checkpoint.py says why
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=bound)
    if name == "muse_glimmer":
        _images_give_transformers_logits(folder, hf, model)

    spec = model_spec(name, model_section.flavor)
    export_hf(model.state_dict(), spec, str(folder), str(folder), tmp_path / "hf")
    exported, source = (
        load_file(tmp_path / "hf" / "model.safetensors"),
        load_file(folder / "model.safetensors"),
    )
    assert exported.keys() == source.keys()
    for key, tensor in source.items():
        assert torch.equal(exported[key], tensor), key


def _images_give_transformers_logits(folder, hf, model) -> None:
    """A prompt with two images of different grids (4x6 and 4x2 patches, the 3x3 learned
    positions resampled to each) through the derived vision tower, adapter and projection:
    transformers' logits within the family's bound."""
    import numpy as np
    import PIL.Image

    from torchtitan_rl.models.vision import encoder_inputs
    from torchtitan_rl.vision.preprocess import ImageProcessorConfig, placeholder_count, preprocess
    from torchtitan_rl.vision.prompts import prompt_images

    patch, start, end = 68, 69, 70
    rng = np.random.default_rng(0)
    images = [
        PIL.Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        for h, w in ((56, 84), (60, 30))
    ]
    pixel_values_PX, grid_thw_N3 = preprocess(images, ImageProcessorConfig.from_checkpoint(folder))
    ids = [3, 10, 11]
    for grid in grid_thw_N3:
        ids += [start] + [patch] * placeholder_count(grid, 2) + [end] + [12, 13]
    tokens_1T = torch.tensor([ids + [14, 4, 3, 15]])
    shown = prompt_images(tokens_1T[0].tolist(), pixel_values_PX, grid_thw_N3, patch, 2)
    with torch.no_grad():
        expected = hf(
            input_ids=tokens_1T, pixel_values=pixel_values_PX, image_grid_thw=grid_thw_N3
        ).logits[0]
        logits = model(
            tokens_1T,
            positions=torch.arange(tokens_1T.shape[1])[None],
            vision=encoder_inputs([shown], [0], 14, 2),
        )[0]
        text_only = model(tokens_1T, positions=torch.arange(tokens_1T.shape[1])[None])[0]
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-4)
    assert (text_only - expected).abs().max() > 0.1  # the images are read


def _with(folder, **fields):
    """config.json with `fields` set; a table's (text_config: {...}) merged into its own."""
    config = json.loads((folder / "config.json").read_text())
    for key, value in fields.items():
        merge = isinstance(value, dict) and isinstance(config.get(key), dict)
        config[key] = {**config[key], **value} if merge else value
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    ("name", "make", "fields", "words"),
    [
        ("llama3", llama, {"attention_bias": True}, "config.json's attention_bias = true"),
        ("llama3", llama, {"mlp_bias": True}, "config.json's mlp_bias = true"),
        ("llama3", llama, {"hidden_act": "gelu"}, 'config.json\'s hidden_act = "gelu"'),
        (
            "llama3",
            llama,
            {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
            "config.json's rope_type = \"dynamic\" is not a RoPE torchtitan's llama3 has",
        ),
        ("llama3", llama, {"head_dim": 32}, "config.json's head_dim = 32 differs"),
        ("qwen3", qwen3, {"use_sliding_window": True}, "use_sliding_window = true"),
        (
            "qwen3",
            qwen3,
            {"layer_types": ["sliding_attention", "full_attention"]},
            'layer_types = "sliding_attention"',
        ),
        ("qwen3", llama, {}, "is a LlamaForCausalLM: set model.name = 'llama3'"),
        (
            "qwen3_5",
            qwen3_5,
            {"layer_types": ["linear_attention", "full_attention", "full_attention"]},
            "is not full attention every k-th layer",
        ),
        ("qwen3_5", qwen3_5, {"tie_word_embeddings": True}, "tie_word_embeddings = true"),
        ("qwen3", qwen3, {"num_key_value_heads": None}, "config.json has no num_key_value_heads"),
        (
            "muse_glimmer",
            muse_glimmer,
            {"text_config": {"layer_rope_theta": [0, 1e4, 2e4, 2e4, 0]}},
            "config.json's text_config.layer_rope_theta = 10000.0 differs from rope_theta",
        ),
        (
            "muse_glimmer",
            muse_glimmer,
            {"text_config": {"hidden_activation": "gelu"}},
            'text_config.hidden_activation = "gelu" is not the SiLU gate',
        ),
        (
            "muse_glimmer",
            muse_glimmer,
            {
                "vision_config": {
                    "layer_types": ["full_attention", "window_attention", "full_attention"]
                }
            },
            "is not global attention every k-th and the last layer",
        ),
        ("muse_glimmer", muse_glimmer, {"text_config": None}, "config.json has no text_config"),
    ],
)
def test_a_field_the_model_cannot_express_is_one_line(name, make, fields, words, tmp_path):
    folder = _with(make(tmp_path / "ckpt"), **fields)
    with pytest.raises(ConfigError) as error:
        ModelSection(name=name, hf_checkpoint=str(folder)).validate()
    message = str(error.value)
    assert "\n" not in message and words in message, message
    assert message.startswith(("model.hf_checkpoint = ", "model.name = "))


def test_auto_reads_every_family_and_without_a_checkpoint_is_one_line():
    assert set(from_hf._READERS) == set(FAMILIES)
    unresolved = ModelSection(tokenizer_path=str(TOKENIZER))
    with pytest.raises(ConfigError, match="which is unset: set model.hf_checkpoint, or name"):
        unresolved.validate()
    unresolved.resolve()  # random weights: the project's tiny model
    assert unresolved.flavor == "tiny"
    named = ModelSection(flavor="debugmodel", hf_checkpoint=str(TOKENIZER))
    assert named.flavor == "debugmodel"  # a named flavor stays
