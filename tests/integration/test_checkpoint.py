"""Checkpoints: exact resume after SIGKILL, torn checkpoints skipped, async saves, HF export.

Real runs: torchrun with 2 ranks, the real vLLM engine, DCP files on disk, SIGKILL.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.launch import REPO, kill_tree, run_dist, run_train, start_train, wait_for_step
from safetensors.torch import load_file

from torchtitan_rl.checkpoint import MANIFEST, invalid_reason

PROMPT, GREEDY_TOKENS = "echo 123:", 8
FLAGS = (
    "--job.config_file",
    "run_configs/debug_cpu.toml",
    "--training.steps",
    "6",
    "--training.lr",
    "1e-2",
    "--checkpoint.enable",
    "true",
    "--checkpoint.interval",
    "3",
    "--checkpoint.export_hf_at_end",
    "true",
)
# Wall-clock figures differ between runs; everything else must not.
TIMING = ("time/", "throughput/")


def rows(folder: Path) -> dict[int, dict]:
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    return {row["step"]: row for row in map(json.loads, lines)}


def weights(hf_folder: Path) -> dict[str, torch.Tensor]:
    return load_file(hf_folder / "model.safetensors")


@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> Path:
    """6 uninterrupted steps (checkpoints at 3 and 6), then the generator's greedy tokens."""
    out = tmp_path_factory.mktemp("full")
    run_dist(
        "train_then_greedy.py",
        PROMPT,
        str(GREEDY_TOKENS),
        *FLAGS,
        "--job.dump_folder",
        str(out),
        nproc=2,
    )
    return out


def kill_during_step_5(out: Path) -> None:
    """Start the run and SIGKILL the launcher and both ranks once step 4 is logged."""
    process = start_train(*FLAGS, "--job.dump_folder", str(out), nproc=2)
    try:
        wait_for_step(process, out, 4)
    finally:
        kill_tree(process)


def test_sigkill_then_restart_matches_the_uninterrupted_run(full_run, tmp_path):
    out = tmp_path / "killed"
    kill_during_step_5(out)
    checkpoints = out / "checkpoints"
    assert (checkpoints / "step-3" / MANIFEST).is_file()
    assert not (checkpoints / "step-6").exists(), "killed too late: step 6 was saved"

    # A save torn by a crash (a truncated shard) and one that never finished (a .tmp folder).
    torn = checkpoints / "step-5"
    shutil.copytree(checkpoints / "step-3", torn)
    shard = torn / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    (checkpoints / "step-6.tmp").mkdir(exist_ok=True)
    (checkpoints / "step-6.tmp" / "__0_0.distcp").write_bytes(b"partial")

    result = run_train(*FLAGS, "--job.dump_folder", str(out), nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed from {checkpoints / 'step-3'}" in result.stdout, result.stdout[-2000:]
    assert f"skipping checkpoint {torn}: __1_0.distcp has" in result.stderr
    assert f"removing {checkpoints / 'step-6.tmp'}" in result.stderr

    expected, resumed = rows(full_run), rows(out)
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6]  # the killed run's step 4 row was replaced
    for step in (4, 5, 6):
        for key, value in expected[step].items():
            if not key.startswith(TIMING):
                assert resumed[step][key] == pytest.approx(value, rel=1e-6, abs=1e-7), (step, key)
    final, reference = weights(out / "hf"), weights(full_run / "hf")
    assert final.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(final[name], tensor), name


def test_async_checkpoints_publish_complete_folders(full_run, tmp_path):
    out = tmp_path / "async"
    result = run_train(
        *FLAGS, "--checkpoint.async_mode", "async", "--job.dump_folder", str(out), nproc=2
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for step in (3, 6):
        assert invalid_reason(out / "checkpoints" / f"step-{step}") is None
    assert not list((out / "checkpoints").glob("*.tmp"))
    for name, tensor in weights(full_run / "hf").items():
        assert torch.equal(weights(out / "hf")[name], tensor), name


def test_exported_policy_matches_the_generator_in_vllm_and_transformers(full_run):
    from transformers import AutoModelForCausalLM

    generator_tokens = json.loads((full_run / "greedy.json").read_text())
    assert generator_tokens
    native = subprocess.run(
        [
            sys.executable,
            str(REPO / "tests" / "helpers" / "vllm_greedy.py"),
            str(full_run / "hf"),
            PROMPT,
            str(GREEDY_TOKENS),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert native.returncode == 0, native.stderr[-3000:]
    vllm_tokens = json.loads(native.stdout.splitlines()[-1])["token_ids"]
    # The run's generator stops at EOS; the helper ignores it.
    assert vllm_tokens[: len(generator_tokens)] == generator_tokens

    from tokenizers import Tokenizer

    prompt_ids = Tokenizer.from_file(str(full_run / "hf" / "tokenizer.json")).encode(PROMPT).ids
    model = AutoModelForCausalLM.from_pretrained(full_run / "hf", dtype=torch.float32)
    output = model.generate(
        torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=len(generator_tokens)
    )
    assert output[0, len(prompt_ids) :].tolist() == generator_tokens
    # The trained weights were exported, not the starting ones.
    start = weights(REPO / "assets" / "tiny_qwen3")
    assert any(not torch.equal(t, start[k]) for k, t in weights(full_run / "hf").items())


def test_export_script_writes_the_same_weights(full_run, tmp_path):
    out = tmp_path / "exported"
    command = [sys.executable, str(REPO / "scripts" / "export_hf.py")]
    result = subprocess.run(
        [*command, str(full_run / "checkpoints" / "step-6"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for name, tensor in weights(full_run / "hf").items():
        assert torch.equal(weights(out)[name], tensor), name
    assert (out / "config.json").read_text() == (full_run / "hf" / "config.json").read_text()

    missing = subprocess.run(
        [*command, str(tmp_path / "nope"), "--out", str(out)], capture_output=True, text=True
    )
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'nope'} is not a complete checkpoint: no such folder"
    ]


def copy_of(full_run: Path, tmp_path: Path) -> Path:
    out = tmp_path / "copy"
    shutil.copytree(full_run / "checkpoints", out / "checkpoints")
    return out


def test_checkpoint_of_another_model_is_refused(full_run, tmp_path):
    out = copy_of(full_run, tmp_path)
    result = run_train(
        *FLAGS,
        "--model.name",
        "llama3",
        "--model.hf_checkpoint",
        "assets/tiny_llama3",
        "--job.dump_folder",
        str(out),
    )
    assert result.returncode == 2
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("error: ")
    assert (
        "holds a checkpoint of model qwen3/tiny, but model.name/model.flavor are llama3/tiny"
        in error
    )
    assert "job.dump_folder" in error


def test_resume_from_a_step_without_checkpoint_is_refused(full_run, tmp_path):
    out = copy_of(full_run, tmp_path)
    result = run_train(*FLAGS, "--checkpoint.resume_from", "4", "--job.dump_folder", str(out))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "error: checkpoint.resume_from = 4: no complete checkpoint of that step in "
        f"{out / 'checkpoints'} (complete: [3, 6]); pick one of them or unset it"
    )
