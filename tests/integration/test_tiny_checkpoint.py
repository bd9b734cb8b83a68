"""The tiny HF checkpoint: the script makes the same bytes for the same seed, and vLLM's greedy
completion of it is torchtitan's argmax.

    .venv/bin/python -m pytest tests/integration/test_tiny_checkpoint.py
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.launch import REPO, run_helper
from helpers.titan import torchtitan_logits

TINY = REPO / "assets" / "tiny_qwen3"
PROMPT = "echo 123: 123"


def make(*outs: tuple[Path, int]) -> None:
    """Run scripts/make_tiny_checkpoint.py for each (folder, seed), each its own process, all
    at once."""
    script = str(REPO / "scripts" / "make_tiny_checkpoint.py")
    processes = [
        subprocess.Popen(
            [sys.executable, script, "--out", str(out), "--seed", str(seed)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for out, seed in outs
    ]
    for process in processes:
        _, stderr = process.communicate(timeout=300)
        assert process.returncode == 0, stderr.decode()[-3000:]


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path):
    make((tmp_path / "a", 0), (tmp_path / "b", 0), (tmp_path / "c", 1))
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert names == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "torchtitan.json",
    ]
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    a = (tmp_path / "a" / "model.safetensors").read_bytes()
    assert a != (tmp_path / "c" / "model.safetensors").read_bytes()
    assert (tmp_path / "a" / "model.safetensors").stat().st_size < 5 * 2**20


MAX_TOKENS = {"qwen3": 6, "gpt_oss": 30, "deepseek_v3": 30, "kimi_k2_7": 30}


@pytest.fixture(scope="module")
def native_greedy() -> dict[str, dict]:
    """vLLM's own model class greedy-decoding each tiny checkpoint, one engine after another in
    one process: {name: {"token_ids": ..., "logprobs": ...}}."""
    args = [
        str(part)
        for name, n in MAX_TOKENS.items()
        for part in (REPO / "assets" / f"tiny_{name}", PROMPT, n)
    ]
    result = run_helper("vllm_greedy.py", *args)
    return dict(zip(MAX_TOKENS, json.loads(result.stdout.strip().splitlines()[-1]), strict=True))


@pytest.mark.parametrize("name", list(MAX_TOKENS))
def test_vllm_loads_it_and_greedy_matches_torchtitan(name, native_greedy):
    """vLLM's own model class for the checkpoint (Qwen3ForCausalLM, GptOssForCausalLM: its
    sinks and sliding window in its CPU kernel, its YaRN RoPE; DeepseekV3ForCausalLM for
    DeepSeek-V3 and Kimi: latent attention without its MLA kernel, sigmoid routing with the
    correction bias, shared experts) reads what the adapter wrote. gpt-oss's, DeepSeek-V3's and
    Kimi's 43 tokens cross the 32-token original context of their YaRN RoPE (gpt-oss's
    16-token window too)."""
    from transformers import AutoTokenizer

    path = REPO / "assets" / f"tiny_{name}"
    out = native_greedy[name]
    assert len(out["token_ids"]) == MAX_TOKENS[name]

    # Replay vLLM's completion through torchtitan: each token must be the argmax, with the
    # logprob vLLM reported (fp32; generator and trainer differ by ~1e-6, see DESIGN.md).
    ids = AutoTokenizer.from_pretrained(path)(PROMPT)["input_ids"]
    logprobs_TV = torch.log_softmax(
        torchtitan_logits(str(path), ids + out["token_ids"], "tiny", name).float(), dim=-1
    )
    for i, token in enumerate(out["token_ids"]):
        row = logprobs_TV[len(ids) - 1 + i]
        assert int(row.argmax()) == token
        assert abs(float(row[token]) - out["logprobs"][i]) < 1e-4
