"""LoRA RL: adapters train on a frozen policy, the generator gets merged weights in place.

    .venv/bin/python -m pytest tests/integration/test_lora.py

Real parts: torchtitan's LoRA converter on the tiny Qwen3, FSDP over 2 torchrun ranks, the
batch-invariant kernels, transformers on the export, and (end to end: the session's LoRA run,
tests/integration/conftest.py) the real vLLM engine. Killed and resumed: test_resume.py.
"""

import shutil

import pytest
import torch
from helpers import runs
from helpers.launch import (
    metric_rows,
    run_dist,
    run_script,
    run_train,
)
from safetensors.torch import load_file


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


# The HF names of the linears LoRA adapts ("all": attention and MLP).
ADAPTED_HF = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_vllm_logprobs_equal_the_trainer_s_and_syncs_move_only_adapted_linears(lora_run):
    rows = {row["step"]: row for row in metric_rows(lora_run)}
    assert [row["logprob_diff/max"] for row in rows.values()] == [0.0] * 6
    runs.assert_distilled_from_an_equal_start(list(rows.values()))
    exported = load_file(lora_run / "hf" / "model.safetensors")
    adapted = sum(t.numel() * 4 for n, t in exported.items() if n.split(".")[-2] in ADAPTED_HF)
    everything = sum(t.numel() * 4 for t in exported.values())
    # The first sync writes every weight, later ones only what a step changes.
    assert rows[1]["weight_sync/bytes"] == everything > adapted
    assert {rows[step]["weight_sync/bytes"] for step in range(2, 7)} == {float(adapted)}


def test_the_export_script_merges_a_lora_checkpoint_as_the_run_did(lora_run, tmp_path):
    checkpoint = lora_run / "checkpoints" / "step-6"
    result = run_script("export_hf.py", str(checkpoint), "--out", str(tmp_path / "hf"))
    assert result.returncode == 0, result.stderr[-3000:]
    written, reference = (
        load_file(f / "model.safetensors") for f in (tmp_path / "hf", lora_run / "hf")
    )
    assert written.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(written[name], tensor), name


def test_a_lora_checkpoint_does_not_resume_a_full_run(lora_run, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(lora_run, out)
    result = run_train(*runs.LORA, "--lora.enable", "false", "--job.dump_folder", str(out))
    assert result.returncode == 2
    error = result.stderr.strip().splitlines()[-1]
    assert "holds a checkpoint with lora = {'enable': True, 'rank': 8" in error, error
    assert "but this run has lora = None" in error
