"""The tiny HF checkpoint: deterministic, and loaded alike by torchtitan, transformers and vLLM.

.venv/bin/python -m pytest tests/unit/test_tiny_checkpoint.py
"""

import json

import torch
from helpers.launch import REPO

from torchtitan_rl import platform
from torchtitan_rl.config.job_config import ModelSection
from torchtitan_rl.trainer.model import build_spec, load_hf_weights

TINY = REPO / "assets" / "tiny_qwen3"
PROMPT = "echo 123: 123"


def torchtitan_logits(ids: list[int]) -> torch.Tensor:
    """Logits of the unsharded torchtitan model loaded through the spec's HF adapter."""
    platform.patch_torchtitan()
    spec = build_spec(ModelSection(hf_checkpoint=str(TINY)))
    model = spec.model.build()
    model.init_states()
    load_hf_weights(model, spec, str(TINY))
    tokens_BT = torch.tensor([ids])
    with torch.no_grad():
        return model(tokens_BT, torch.arange(len(ids))[None], None)[0]


def test_tokenizer_round_trips_task_text():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TINY)
    text = "echo 907: 907\nwhat is 12+30? \\boxed{42}"
    ids = tokenizer(text)["input_ids"]
    assert len(ids) == len(text)  # one token per character
    assert tokenizer.decode(ids) == text
    assert tokenizer.unk_token_id not in ids
    config = json.loads((TINY / "config.json").read_text())
    assert len(tokenizer) == config["vocab_size"]
    assert tokenizer.eos_token_id == config["eos_token_id"]


def test_transformers_loads_it_with_torchtitan_logits():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = AutoTokenizer.from_pretrained(TINY)(PROMPT)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(TINY)
    with torch.no_grad():
        hf_logits = model(torch.tensor([ids])).logits[0]
    titan = torchtitan_logits(ids)
    assert hf_logits.shape == titan.shape == (len(ids), 68)
    torch.testing.assert_close(titan, hf_logits, rtol=1e-5, atol=1e-5)
    assert hf_logits.std() > 0.05  # real weights, not zeros
