"""Batch-invariant mode for real: the vLLM engine and the FSDP trainer on 2 ranks, bitwise.
The kernels themselves: tests/unit/test_batch_invariant.py.

    .venv/bin/python -m pytest tests/integration/test_batch_invariant.py
"""

import json
from pathlib import Path

import pytest
from helpers import runs
from helpers.launch import DEBUG_TOML, metric_rows, run_dist

# Prompts up to 206 tokens: longer than vLLM's 128-token CPU KV block.
LONG_PROMPTS = ("--generator.max_model_len", "320", "--training.max_prompt_len", "256")


def probe(out: Path, *flags: str) -> dict:
    """tests/dist/batch_invariant_run.py on 2 ranks: RL steps (FSDP=2, weight sync after
    each), then mixed-length prompts, one prompt alone and among 16 sequences: its figures."""
    run_dist(
        "batch_invariant_run.py",
        str(out / "result.json"),
        *("--job.config_file", DEBUG_TOML, *LONG_PROMPTS, *flags),
        *("--job.dump_folder", str(out / "run")),
        nproc=2,
    )
    result = json.loads((out / "result.json").read_text())
    assert result["longest_prompt_tokens"] > 128
    return result


def test_demo_learns_with_every_step_bitwise_on_policy_and_any_batch_after(tmp_path):
    """The echo demo (100 steps) in batch-invariant mode: every step's generator and trainer
    logprobs are equal, it learns, and on the trained weights every batch composition gives
    the trainer's logprobs exactly."""
    result = probe(tmp_path, "--batch_invariant", "true")
    rows = metric_rows(tmp_path / "run")
    assert len(rows) == 100 == len(result["steps"])
    assert all(row["batch_invariant"] == 1.0 for row in rows)
    assert [row["logprob_diff/max"] for row in rows] == [0.0] * 100
    assert [step["logprob_diff/max"] for step in result["steps"]] == [0.0] * 100
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
    assert [result["mixed_lengths"], result["alone"], result["among_16"]] == [0.0] * 3, result
    assert result["alone_equals_among_16"]


@pytest.mark.parametrize(
    ("dtype", "mode", "model"),
    [
        ("bfloat16", "true", "moe"),
        ("bfloat16", "true", "gpt_oss"),
        ("float32", "false", "dense"),
        ("bfloat16", "false", "dense"),
    ],
)
def test_generator_and_trainer_logprobs_under_torchrun(dtype, mode, model, tmp_path):
    """3 RL steps that move the weights, then the probes: with the mode on every difference
    is exactly 0.0; off, the same measurement is not (so this test can fail). float32 with the
    mode on is the demo above. The bf16 case with the mode on is the mixture-of-experts tiny
    Qwen3 with its experts split over the ranks (EP = 2): routing is a top-k of batch-invariant
    gate logits, so both sides pick the same experts, whose batch-invariant GEMMs then give
    the same bits however many tokens share an expert. The other bf16 case with the mode on is
    the tiny gpt-oss (EP = 2), whose prompts of up to 200 tokens cross its 16-token sliding
    window, with its attention sinks: both sides attend with `ops.attention` and rescale by
    its chunked logsumexp."""
    model_flags = {"moe": runs.MOE_MODEL, "gpt_oss": runs.GPT_OSS_MODEL}.get(model, ())
    result = probe(
        tmp_path,
        *("--training.steps", "3", "--training.lr", "1e-2", *model_flags),
        *("--model.dtype", dtype, "--generator.dtype", dtype, "--batch_invariant", mode),
    )
    diffs = [step["logprob_diff/max"] for step in result["steps"]]
    diffs += [result["mixed_lengths"], result["alone"], result["among_16"]]
    if mode == "true":
        assert diffs == [0.0] * 6, result
        assert [step["offpolicy/ratio_max"] for step in result["steps"]] == [1.0] * 3
        assert result["alone_equals_among_16"]
    else:
        assert max(diffs) > 0.0, result
