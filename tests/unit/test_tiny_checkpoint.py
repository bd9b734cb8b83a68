"""The tiny HF checkpoint read by transformers and torchtitan alike; its tokenizer. Its
determinism (as the script's process) and vLLM on it: tests/integration/test_tiny_checkpoint.py.

    .venv/bin/python -m pytest tests/unit/test_tiny_checkpoint.py
"""

import json

import pytest
import torch
from helpers.launch import REPO
from helpers.titan import torchtitan_logits

TINY = REPO / "assets" / "tiny_qwen3"
PROMPT = "echo 123: 123"


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


@pytest.mark.parametrize(
    ("name", "flavor", "architecture"),
    [
        ("qwen3", "tiny", "Qwen3ForCausalLM"),
        ("qwen3", "tiny_moe", "Qwen3MoeForCausalLM"),
        ("gpt_oss", "tiny", "GptOssForCausalLM"),
        ("deepseek_v3", "tiny", "DeepseekV3ForCausalLM"),
        ("deepseek_v3", "tiny_grouped", "DeepseekV3ForCausalLM"),
        ("kimi_k2_7", "tiny", "DeepseekV3ForCausalLM"),
        ("muse_glimmer", "tiny", "MuseGlimmerForConditionalGeneration"),
        ("qwen3_5", "tiny", "Qwen3_5ForCausalLM"),
        ("qwen3_5", "tiny_moe", "Qwen3_5MoeForCausalLM"),
    ],
)
def test_transformers_loads_it_with_torchtitan_logits(name, flavor, architecture):
    """The dense and the mixture-of-experts tiny checkpoints: HF's own model class gives the
    logits of the torchtitan model (the MoE's experts run in fp32, as HF's: models/moe.py).
    gpt-oss's prompt (53 tokens) crosses its 16-token sliding window and the 32-token original
    context of its YaRN RoPE; HF's eager attention is its reference for sinks. DeepSeek-V3's
    and Kimi's (53 tokens too) cross their YaRN context, through multi-head latent attention
    (YaRN's scale on the softmax), shared experts and sigmoid routing with a nonzero correction
    bias, in groups for `tiny_grouped` (HF's class implements `n_group`/`topk_group`).
    Muse Glimmer's (53 tokens) crosses its 16-token window, through its NoPE global layer, the
    gated attention, post-norms and the soft-capped head; HF's class is the vision-language
    model's, whose 1-layer vision tower the text's logits do not read. Its bound is 1e-4, not
    1e-5: QK-norm then the query scale make attention logits up to ~44, whose softmax
    amplifies the fp32 rounding of two RoPE formulas (measured 4.4e-5); a window one key off,
    a post-norm eps of 1e-6 or the query scale 7.7 for 7.74 each move a logit by 0.07 to 5.7.
    Qwen3.5's (dense and MoE, 167 tokens: three of the recurrence's 64-token chunks) goes
    through three Gated DeltaNet layers (HF's own PyTorch recurrence against gated_delta.py's)
    and the gated full-attention layer with RoPE on a quarter of each head (measured: 2.4e-7)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    path = REPO / "assets" / f"{flavor}_{name}"
    repeats = {"qwen3": 1, "llama3": 1, "qwen3_5": 12}.get(name, 4)
    prompt = " ".join([PROMPT] * repeats)
    ids = AutoTokenizer.from_pretrained(path)(prompt)["input_ids"]
    auto = AutoModelForImageTextToText if name == "muse_glimmer" else AutoModelForCausalLM
    model = auto.from_pretrained(path, attn_implementation="eager")
    assert type(model).__name__ == architecture
    with torch.no_grad():
        hf_logits = model(torch.tensor([ids])).logits[0]
    titan = torchtitan_logits(str(path), ids, flavor, name)
    assert hf_logits.shape == titan.shape == (len(ids), 68)
    bound = 1e-4 if name == "muse_glimmer" else 1e-5
    torch.testing.assert_close(titan, hf_logits, rtol=1e-5, atol=bound)
    assert hf_logits.std() > 0.05  # real weights, not zeros
    if name in ("deepseek_v3", "kimi_k2_7"):  # the bias routes: HF reads it too
        bias = model.model.layers[1].mlp.gate.e_score_correction_bias
        assert bias.abs().min() > 0
