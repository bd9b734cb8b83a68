"""Batch-invariant mode: kernels, then the real thing (vLLM engine + FSDP trainer, 2 ranks).

.venv/bin/python -m pytest tests/integration/test_batch_invariant.py
"""

import json

import pytest
import torch
from helpers.launch import run_dist, run_train

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


PROBE_FLAGS = (
    "--job.config_file",
    "run_configs/debug_cpu.toml",
    "--training.steps",
    "3",
    "--training.lr",
    "1e-2",
    # Prompts up to 206 tokens: longer than vLLM's 128-token CPU KV block.
    "--generator.max_model_len",
    "320",
    "--training.max_prompt_len",
    "256",
)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["true", "false"])
def test_generator_and_trainer_logprobs_under_torchrun(dtype, mode, tmp_path):
    """3 RL steps (FSDP=2, weight sync after each), then mixed-length prompts, one prompt
    alone and among 16 sequences: with the mode on every difference is exactly 0.0; off, the
    same measurement is not (so this test can fail)."""
    out = tmp_path / "result.json"
    run_dist(
        "batch_invariant_run.py",
        str(out),
        *PROBE_FLAGS,
        "--model.dtype",
        dtype,
        "--generator.dtype",
        dtype,
        "--batch_invariant",
        mode,
        "--job.dump_folder",
        str(tmp_path / "run"),
        nproc=2,
    )
    result = json.loads(out.read_text())
    assert result["longest_prompt_tokens"] > 128
    diffs = [step["logprob_diff/max"] for step in result["steps"]]
    diffs += [result["mixed_lengths"], result["alone"], result["among_16"]]
    if mode == "true":
        assert diffs == [0.0] * 6, result
        assert [step["offpolicy/ratio_max"] for step in result["steps"]] == [1.0] * 3
        assert result["alone_equals_among_16"]
    else:
        assert max(diffs) > 0.0, result


def test_demo_learns_with_every_step_bitwise_on_policy(tmp_path):
    result = run_train(
        "--job.config_file",
        "run_configs/debug_cpu.toml",
        "--batch_invariant",
        "true",
        "--job.dump_folder",
        str(tmp_path),
        nproc=2,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 100
    assert all(row["batch_invariant"] == 1.0 for row in rows)
    assert [row["logprob_diff/max"] for row in rows] == [0.0] * 100
    assert (
        {row["offpolicy/ratio_max"] for row in rows}
        == {row["offpolicy/ratio_min"] for row in rows}
        == {1.0}
    )
    # Synchronous and bitwise: nothing is off-policy, so the KL(behaviour || old) is 0.
    assert {row["offpolicy/kl"] for row in rows} == {0.0}
    first, last = rows[:5], rows[-10:]
    assert sum(r["reward/mean"] for r in first) / 5 < 0.2
    assert sum(r["reward/mean"] for r in last) / 10 > 0.9
