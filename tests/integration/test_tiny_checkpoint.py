"""The tiny HF checkpoint: deterministic, and loaded alike by torchtitan, transformers and vLLM.

.venv/bin/python -m pytest tests/integration/test_tiny_checkpoint.py
"""

import json
import subprocess
import sys
from pathlib import Path

import torch
from helpers.launch import REPO

from torchtitan_rl import platform
from torchtitan_rl.config.job_config import ModelSection
from torchtitan_rl.trainer.model import build_spec, load_hf_weights

TINY = REPO / "assets" / "tiny_qwen3"
PROMPT = "echo 123: 123"


def make(out: Path, seed: int = 0) -> None:
    subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "make_tiny_checkpoint.py"),
            "--out",
            str(out),
            "--seed",
            str(seed),
        ],
        check=True,
        capture_output=True,
    )


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path):
    make(tmp_path / "a")
    make(tmp_path / "b")
    make(tmp_path / "c", seed=1)
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


def test_vllm_loads_it_and_greedy_matches_torchtitan():
    from transformers import AutoTokenizer

    max_tokens = 6
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "tests" / "helpers" / "vllm_greedy.py"),
            str(TINY),
            PROMPT,
            str(max_tokens),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(out["token_ids"]) == max_tokens

    # Replay vLLM's completion through torchtitan: each token must be the argmax, with the
    # logprob vLLM reported (fp32; generator and trainer differ by ~1e-6, see DESIGN.md).
    ids = AutoTokenizer.from_pretrained(TINY)(PROMPT)["input_ids"]
    logprobs_TV = torch.log_softmax(torchtitan_logits(ids + out["token_ids"]).float(), dim=-1)
    for i, token in enumerate(out["token_ids"]):
        row = logprobs_TV[len(ids) - 1 + i]
        assert int(row.argmax()) == token
        assert abs(float(row[token]) - out["logprobs"][i]) < 1e-4
