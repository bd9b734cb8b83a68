"""LoRA config and targets, in process: bad values refused, the demo config, the linears each
lora.target adapts. Real runs: tests/integration/test_lora.py and test_resume.py.

    .venv/bin/python -m pytest tests/unit/test_lora.py
"""

import pytest
import torch
from helpers.launch import REPO

from torchtitan_rl.config import ConfigError, JobConfig, LoRASection, parse_args


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
    config.resolve()
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

    config = JobConfig()
    config.resolve()  # random weights: model.flavor 'auto' is 'tiny'
    spec = build_spec(config.model)
    with torch.device("meta"):
        model = convert(spec.model, LoRASection(enable=True, target=target)).build()
    adapted = adapted_modules(model)
    assert {name.rsplit(".", 1)[-1] for name in adapted} == linears
    assert len(adapted) == 2 * len(linears)  # the tiny model's 2 layers
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"{m}.{ab}.weight" for m in adapted for ab in ("lora_a", "lora_b")}
