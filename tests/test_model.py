"""Building torchtitan models from the `model` section and loading HF checkpoints into them.

.venv/bin/python -m pytest tests/test_model.py
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from torchtitan_rl import platform
from torchtitan_rl.config.job_config import ConfigError, ModelSection
from torchtitan_rl.trainer.model import build_model

TINY = Path(__file__).resolve().parents[1] / "assets" / "tiny_qwen3"


@pytest.fixture(autouse=True)
def _cpu():
    platform.patch_torchtitan()


def test_loads_every_tensor_of_the_checkpoint():
    model = build_model(ModelSection(hf_checkpoint=str(TINY)), torch.device("cpu"), seed=123)
    hf = load_file(TINY / "model.safetensors")
    assert torch.equal(
        model.layers["1"].feed_forward.w2.weight, hf["model.layers.1.mlp.down_proj.weight"]
    )
    assert torch.equal(model.tok_embeddings.weight, hf["model.embed_tokens.weight"])
    assert model.lm_head.weight is model.tok_embeddings.weight  # tied embeddings stay tied


def test_random_init_is_seeded():
    a = build_model(ModelSection(tokenizer_path=str(TINY)), torch.device("cpu"), seed=1)
    b = build_model(ModelSection(tokenizer_path=str(TINY)), torch.device("cpu"), seed=1)
    c = build_model(ModelSection(tokenizer_path=str(TINY)), torch.device("cpu"), seed=2)
    wq = "layers.0.attention.qkv_linear.wq.weight"
    assert torch.equal(a.state_dict()[wq], b.state_dict()[wq])
    assert not torch.equal(a.state_dict()[wq], c.state_dict()[wq])


def test_bfloat16_casts_parameters_but_not_the_rope_cache():
    model = build_model(
        ModelSection(hf_checkpoint=str(TINY), dtype="bfloat16"), torch.device("cpu")
    )
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {b.dtype for b in model.buffers()} == {torch.float32}


def test_wrong_flavor_names_the_first_mismatching_key_and_shapes():
    with pytest.raises(ConfigError) as e:
        build_model(ModelSection(hf_checkpoint=str(TINY), flavor="debugmodel"), torch.device("cpu"))
    message = str(e.value)
    assert "'tok_embeddings.weight' has shape (64, 128)" in message
    assert "model.flavor = 'debugmodel' expects (2048, 256)" in message
    assert "\n" not in message


def test_missing_tensor_is_named(tmp_path):
    shutil.copytree(TINY, tmp_path / "ckpt")
    state = load_file(tmp_path / "ckpt" / "model.safetensors")
    del state["model.layers.1.self_attn.k_norm.weight"]
    save_file(state, tmp_path / "ckpt" / "model.safetensors")
    with pytest.raises(ConfigError, match="lacks 'layers.1.attention.k_norm.weight'"):
        build_model(ModelSection(hf_checkpoint=str(tmp_path / "ckpt")), torch.device("cpu"))


def test_checkpoint_without_safetensors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({}))
    with pytest.raises(ConfigError, match="has no \\*.safetensors files"):
        build_model(ModelSection(hf_checkpoint=str(tmp_path)), torch.device("cpu"))
