"""vLLM general plugin: registers the torchtitan model wrapper with vLLM's model registry.

    .venv/bin/python -c "from vllm.plugins import load_general_plugins; load_general_plugins()"

Declared in pyproject.toml under the `vllm.general_plugins` entry-point group, so every process
that starts a vLLM engine finds the architecture without importing this package first.
"""

# The architecture name engines are told to use via hf_overrides={"architectures": [ARCH]}.
ARCH = "TorchTitanForCausalLM"
HYBRID_ARCH = "TorchTitanHybridForCausalLM"
"""The architecture of models with Gated DeltaNet layers (Qwen3.5): vLLM keeps their states."""
VISION_ARCH = "TorchTitanVisionForCausalLM"
"""The architecture of vision-language flavors (Muse Glimmer's): requests carry images."""
HYBRID_HOST_OPS = ("torchtitan_rl::gated_delta_paged",)
"""The hybrid wrapper's ops that run code on the host (generator/hybrid.py): on CUDA the
compiled graph is split at them (platform.generator_compilation)."""


def register() -> None:
    from vllm import ModelRegistry

    modules = {ARCH: "vllm_model", HYBRID_ARCH: "vllm_model", VISION_ARCH: "vision"}
    for arch, module in modules.items():
        if arch not in ModelRegistry.get_supported_archs():
            # A "module:Class" string: vLLM imports the wrapper only when an engine builds it.
            ModelRegistry.register_model(arch, f"torchtitan_rl.generator.{module}:{arch}")
