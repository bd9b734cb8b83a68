"""LoRA RL: adapters train on a frozen policy, the generator gets merged weights in place.

    .venv/bin/python -m pytest tests/test_lora.py

Real parts: torchtitan's LoRA converter on the tiny Qwen3, FSDP over 2 torchrun ranks, the
batch-invariant kernels, transformers on the export, and (end to end) the real vLLM engine.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers.launch import (
    kill_tree,
    run_dist,
    run_script,
    run_train,
    start_train,
    wait_for_step,
)
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("lora")
    run_dist("lora_run.py", str(out), nproc=2)
    return torch.load(out / "result.pt")


def is_adapter(name: str) -> bool:
    return ".lora_a." in name or ".lora_b." in name


def test_only_adapters_train_and_hold_optimizer_state(two_ranks):
    adapters = [n for n in two_ranks["all_names"] if is_adapter(n)]
    # 2 layers x (wqkv, wo, w1, w2, w3) x (A, B)
    assert len(adapters) == 20
    assert two_ranks["trainable"] == adapters
    assert two_ranks["with_state"] == adapters
    # Two steps move every adapter (A only from the second: B starts at zero) and nothing else.
    assert two_ranks["changed"] == adapters


def test_the_generator_copy_is_the_merged_weight_bit_for_bit(two_ranks):
    assert two_ranks["copy_equals_merge"] and all(two_ranks["copy_equals_merge"].values())
    assert len(two_ranks["adapted"]) == 10
    # The first sync writes every weight; later ones only the adapted linears.
    assert two_ranks["first_bytes"] == two_ranks["copy_bytes"]
    assert two_ranks["update_bytes"] == two_ranks["adapted_bytes"] < two_ranks["copy_bytes"]


def test_batch_invariant_trainer_logprobs_equal_the_merged_copy_s(two_ranks):
    trainer, copy = two_ranks["trainer_logprobs_BT"], two_ranks["copy_logprobs_BT"]
    assert torch.equal(trainer, copy)


def test_the_export_is_the_merged_policy_and_the_weights_come_back(two_ranks):
    assert two_ranks["restored_after_export"]
    assert two_ranks["hf_greedy"] == two_ranks["trainer_greedy"]
    assert len(set(two_ranks["trainer_greedy"])) > 1  # not a constant the two could share


# The echo demo with LoRA, batch-invariant, checkpoints at steps 3 and 6, merged export.
E2E_FLAGS = (
    "--job.config_file",
    "run_configs/debug_cpu.toml",
    "--training.steps",
    "6",
    "--training.lr",
    "1e-2",
    "--lora.enable",
    "true",
    "--batch_invariant",
    "true",
    "--checkpoint.enable",
    "true",
    "--checkpoint.interval",
    "3",
    "--checkpoint.export_hf_at_end",
    "true",
)
# The HF names of the linears LoRA adapts ("all": attention and MLP).
ADAPTED_HF = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lora_e2e")
    result = run_train(*E2E_FLAGS, "--job.dump_folder", str(out), nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def test_vllm_logprobs_equal_the_trainer_s_and_syncs_move_only_adapted_linears(uninterrupted):
    rows = metric_rows(uninterrupted)
    assert [row["logprob_diff/max"] for row in rows.values()] == [0.0] * 6
    exported = load_file(uninterrupted / "hf" / "model.safetensors")
    adapted = sum(t.numel() * 4 for n, t in exported.items() if n.split(".")[-2] in ADAPTED_HF)
    everything = sum(t.numel() * 4 for t in exported.values())
    # The first sync writes every weight, later ones only what a step changes.
    assert rows[1]["weight_sync/bytes"] == everything > adapted
    assert {rows[step]["weight_sync/bytes"] for step in range(2, 7)} == {float(adapted)}


def test_sigkill_then_restart_matches_the_uninterrupted_run(uninterrupted, tmp_path):
    out = tmp_path / "killed"
    process = start_train(*E2E_FLAGS, "--job.dump_folder", str(out), nproc=2)
    try:
        wait_for_step(process, out, 4)
    finally:
        kill_tree(process)
    assert not (out / "checkpoints" / "step-6").exists(), "killed too late: step 6 was saved"
    result = run_train(*E2E_FLAGS, "--job.dump_folder", str(out), nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed from {out / 'checkpoints' / 'step-3'}" in result.stdout

    # The checkpoint holds the adapters, optimizer and train state, not the frozen weights.
    saved = FileSystemReader(out / "checkpoints" / "step-3").read_metadata().state_dict_metadata
    model_keys = [k for k in saved if not k.startswith(("optimizer", "lr_scheduler", "train"))]
    assert len(model_keys) == 20 and all(".lora_" in k for k in model_keys), model_keys

    expected, resumed = metric_rows(uninterrupted), metric_rows(out)
    for step in (4, 5, 6):
        for key, value in expected[step].items():
            if not key.startswith(("time/", "throughput/")):
                assert resumed[step][key] == pytest.approx(value, rel=1e-6, abs=1e-7), (step, key)
    final, reference = (load_file(f / "hf" / "model.safetensors") for f in (out, uninterrupted))
    assert final.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(final[name], tensor), name


def test_the_export_script_merges_a_lora_checkpoint_as_the_run_did(uninterrupted, tmp_path):
    checkpoint = uninterrupted / "checkpoints" / "step-6"
    result = run_script("export_hf.py", str(checkpoint), "--out", str(tmp_path / "hf"))
    assert result.returncode == 0, result.stderr[-3000:]
    written, reference = (
        load_file(f / "model.safetensors") for f in (tmp_path / "hf", uninterrupted / "hf")
    )
    assert written.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(written[name], tensor), name


def test_a_lora_checkpoint_does_not_resume_a_full_run(uninterrupted, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(uninterrupted, out)
    result = run_train(*E2E_FLAGS, "--lora.enable", "false", "--job.dump_folder", str(out))
    assert result.returncode == 2
    error = result.stderr.strip().splitlines()[-1]
    assert "holds a checkpoint with lora = {'enable': True, 'rank': 8" in error, error
    assert "but this run has lora = None" in error


def metric_rows(folder: Path) -> dict[int, dict]:
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    return {row["step"]: row for row in map(json.loads, lines)}
