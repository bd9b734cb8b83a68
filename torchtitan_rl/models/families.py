"""The torchtitan model families, and what this project does with each: run it, or refuse it
at config time with the reason.

    .venv/bin/python -m pytest tests/unit/test_models.py

A family is a module under `torchtitan.models`; its flavors live in a registry whose name is not
always `f"{name}_configs"` (gpt_oss's is `gptoss_configs`), so each family names its own.
"""

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Family:
    name: str
    """The module under torchtitan.models."""
    registry: str
    """The module's dict of flavor -> config factory."""
    hf_architectures: tuple[str, str | None]
    """The HF architecture of its dense flavors and of its mixture-of-experts ones (None: it
    has none): what config.json says, and what vLLM's native peer of an export is."""
    refused: str = ""
    """Why the trainer or the generator cannot run it yet ('' where they can)."""
    hf_router_bias: bool = False
    """Whether its HF checkpoints keep the MoE routers' correction bias (DeepSeek-V3's
    `e_score_correction_bias`), so that a run may train it (training.expert_bias_update_rate)."""


FAMILIES = {
    family.name: family
    for family in (
        Family("qwen3", "qwen3_configs", ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")),
        Family("llama3", "llama3_configs", ("LlamaForCausalLM", None)),
        Family("gpt_oss", "gptoss_configs", (None, "GptOssForCausalLM")),
        Family(
            "deepseek_v3",
            "deepseekv3_configs",
            ("DeepseekV3ForCausalLM", "DeepseekV3ForCausalLM"),
            hf_router_bias=True,
        ),
        Family(
            "kimi_k2_7",
            "kimi_k2_5_configs",
            ("DeepseekV3ForCausalLM", "DeepseekV3ForCausalLM"),
            hf_router_bias=True,
        ),
        Family(
            "muse_glimmer",
            "muse_glimmer_configs",
            ("MuseGlimmerForConditionalGeneration", None),
        ),
        Family(
            "qwen3_5",
            "qwen3_5_configs",
            ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"),
        ),
    )
}

SUPPORTED_MODELS = tuple(name for name, family in FAMILIES.items() if not family.refused)
"""The families the trainer and the generator run."""
