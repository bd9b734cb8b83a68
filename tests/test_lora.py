"""LoRA RL: adapters train on a frozen policy, the generator gets merged weights in place.

    .venv/bin/python -m pytest tests/test_lora.py

Real parts: torchtitan's LoRA converter on the tiny Qwen3, FSDP over 2 torchrun ranks, the
batch-invariant kernels, transformers on the export, and (end to end) the real vLLM engine.
"""

import sys
from pathlib import Path

import pytest
import torch
from conftest import run_dist

from torchtitan_rl.config.job_config import ConfigError, JobConfig, LoRASection

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "dist"))


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


@pytest.mark.parametrize(
    ("section", "message"),
    [
        (LoRASection(rank=4), "lora.rank = 4 does nothing while lora.enable = false"),
        (LoRASection(enable=True, rank=0), "lora.rank = 0: must be >= 1"),
        (LoRASection(enable=True, alpha=0.0), "lora.alpha = 0.0: must be > 0"),
    ],
)
def test_bad_lora_values_are_refused(section, message):
    config = JobConfig(lora=section)
    config.model.tokenizer_path = str(REPO / "assets" / "tiny_qwen3")
    with pytest.raises(ConfigError, match=message):
        config.validate()
