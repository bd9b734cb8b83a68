"""Checkpoints of the session's reference run: async saves, the HF export (in vLLM and
transformers, and from scripts/export_hf.py), checkpoints a run must refuse. Killed and resumed
runs: test_resume.py.

    .venv/bin/python -m pytest tests/integration/test_checkpoint.py

Real runs: torchrun with 2 ranks, the real vLLM engine, DCP files on disk.
"""

import json
import shutil
from pathlib import Path

import torch
from helpers import runs
from helpers.launch import REPO, run_helper, run_script, run_train
from safetensors.torch import load_file

from torchtitan_rl.checkpoint import invalid_reason


def weights(hf_folder: Path) -> dict[str, torch.Tensor]:
    return load_file(hf_folder / "model.safetensors")


def test_async_checkpoints_publish_complete_folders(reference_run, tmp_path):
    out = tmp_path / "async"
    result = run_train(
        *runs.REFERENCE, "--checkpoint.async_mode", "async", "--job.dump_folder", str(out), nproc=2
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for step in (3, 6):
        assert invalid_reason(out / "checkpoints" / f"step-{step}") is None
    assert not list((out / "checkpoints").glob("*.tmp"))
    for name, tensor in weights(reference_run.folder / "hf").items():
        assert torch.equal(weights(out / "hf")[name], tensor), name


def test_exported_policy_matches_the_generator_in_vllm_and_transformers(reference_run):
    from transformers import AutoModelForCausalLM

    generator_tokens = json.loads((reference_run.folder / "greedy.json").read_text())
    assert generator_tokens
    native = run_helper(
        "vllm_greedy.py",
        str(reference_run.folder / "hf"),
        runs.GREEDY_PROMPT,
        str(runs.GREEDY_TOKENS),
    )
    vllm_tokens = json.loads(native.stdout.splitlines()[-1])["token_ids"]
    # The run's generator stops at EOS; the helper ignores it.
    assert vllm_tokens[: len(generator_tokens)] == generator_tokens

    from tokenizers import Tokenizer

    prompt_ids = (
        Tokenizer.from_file(str(reference_run.folder / "hf" / "tokenizer.json"))
        .encode(runs.GREEDY_PROMPT)
        .ids
    )
    model = AutoModelForCausalLM.from_pretrained(reference_run.folder / "hf", dtype=torch.float32)
    output = model.generate(
        torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=len(generator_tokens)
    )
    assert output[0, len(prompt_ids) :].tolist() == generator_tokens
    # The trained weights were exported, not the starting ones.
    start = weights(REPO / "assets" / "tiny_qwen3")
    assert any(
        not torch.equal(t, start[k]) for k, t in weights(reference_run.folder / "hf").items()
    )


def test_export_script_writes_the_same_weights(reference_run, tmp_path):
    out = tmp_path / "exported"
    result = run_script(
        "export_hf.py", str(reference_run.folder / "checkpoints" / "step-6"), "--out", str(out)
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for name, tensor in weights(reference_run.folder / "hf").items():
        assert torch.equal(weights(out)[name], tensor), name
    assert (out / "config.json").read_text() == (
        reference_run.folder / "hf" / "config.json"
    ).read_text()

    missing = run_script("export_hf.py", str(tmp_path / "nope"), "--out", str(out))
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'nope'} is not a complete checkpoint: no such folder"
    ]


def copy_of(reference: Path, tmp_path: Path) -> Path:
    out = tmp_path / "copy"
    shutil.copytree(reference / "checkpoints", out / "checkpoints")
    return out


def test_checkpoint_of_another_model_is_refused(reference_run, tmp_path):
    out = copy_of(reference_run.folder, tmp_path)
    result = run_train(
        *runs.REFERENCE,
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


def test_resume_from_a_step_without_checkpoint_is_refused(reference_run, tmp_path):
    out = copy_of(reference_run.folder, tmp_path)
    result = run_train(
        *runs.REFERENCE, "--checkpoint.resume_from", "4", "--job.dump_folder", str(out)
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "error: checkpoint.resume_from = 4: no complete checkpoint of that step in "
        f"{out / 'checkpoints'} (complete: [3, 6]); pick one of them or unset it"
    )
