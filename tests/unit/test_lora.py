"""LoRA RL: adapters train on a frozen policy, the generator gets merged weights in place.

    .venv/bin/python -m pytest tests/test_lora.py

Real parts: torchtitan's LoRA converter on the tiny Qwen3, FSDP over 2 torchrun ranks, the
batch-invariant kernels, transformers on the export, and (end to end) the real vLLM engine.
"""

import json
from pathlib import Path

import pytest
import torch
from helpers.launch import REPO, run_dist, run_train

from torchtitan_rl.config import parse_args
from torchtitan_rl.config.job_config import ConfigError, JobConfig, LoRASection


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("lora")
    run_dist("lora_run.py", str(out), nproc=2)
    return torch.load(out / "result.pt")


def is_adapter(name: str) -> bool:
    return ".lora_a." in name or ".lora_b." in name


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


def metric_rows(folder: Path) -> dict[int, dict]:
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    return {row["step"]: row for row in map(json.loads, lines)}


@pytest.mark.parametrize(
    ("section", "message"),
    [
        (LoRASection(rank=4), "lora.rank = 4 does nothing while lora.enable = false"),
        (LoRASection(enable=True, rank=0), "lora.rank = 0: must be >= 1"),
        (LoRASection(enable=True, alpha=0.0), "lora.alpha = 0.0: must be > 0"),
        (LoRASection(enable=True), "model.hf_checkpoint is unset"),
    ],
)
def test_bad_lora_values_are_refused(section, message):
    config = JobConfig(lora=section)
    config.model.tokenizer_path = str(REPO / "assets" / "tiny_qwen3")
    with pytest.raises(ConfigError, match=message):
        config.validate()


def test_the_lora_demo_config_parses():
    config = parse_args(
        [
            *("--job.config_file", str(REPO / "run_configs" / "arith_lora_from_sft_cpu.toml")),
            # The SFT stage's export, which this test does not produce: the tiny checkpoint.
            *("--model.hf_checkpoint", str(REPO / "assets" / "tiny_qwen3")),
        ],
        world_size=2,
    )
    assert config.lora == LoRASection(enable=True, rank=8, alpha=16.0, target="all")


@pytest.mark.parametrize(
    ("target", "linears"),
    [
        ("attention", {"wqkv", "wo"}),
        ("mlp", {"w1", "w2", "w3"}),
        ("all", {"wqkv", "wo", "w1", "w2", "w3"}),
    ],
)
def test_lora_target_picks_the_linears_that_train(target, linears):
    from torchtitan_rl.trainer.lora import adapted_modules, convert
    from torchtitan_rl.trainer.model import build_spec

    spec = build_spec(JobConfig().model)
    with torch.device("meta"):
        model = convert(spec.model, LoRASection(enable=True, target=target)).build()
    adapted = adapted_modules(model)
    assert {name.rsplit(".", 1)[-1] for name in adapted} == linears
    assert len(adapted) == 2 * len(linears)  # the tiny model's 2 layers
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"{m}.{ab}.weight" for m in adapted for ab in ("lora_a", "lora_b")}
