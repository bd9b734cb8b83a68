"""Build a torchtitan model from the `model` config section and load HF weights into it.

.venv/bin/python -m pytest tests/test_model.py
"""

from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import load_file
from torchtitan.protocols.model_spec import ModelSpec

from torchtitan_rl import platform
from torchtitan_rl.config.job_config import ConfigError, ModelSection
from torchtitan_rl.models import model_spec


def build_spec(model: ModelSection) -> ModelSpec:
    """The model spec of `model.name`/`model.flavor` with this platform's attention."""
    spec = model_spec(model.name, model.flavor, attn_backend=platform.attention_backend())
    platform.use_platform_attention(spec.model)
    return spec


def read_hf_state_dict(path: str) -> dict[str, torch.Tensor]:
    """All tensors of the *.safetensors files in HF checkpoint directory `path` (CPU)."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ConfigError(f"model.hf_checkpoint = {path!r} has no *.safetensors files")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(file))
    return state


def load_hf_weights(model: nn.Module, spec: ModelSpec, path: str) -> None:
    """Copy the HF checkpoint at `path` into `model` through the spec's state-dict adapter.

    Keys or shapes that do not match the flavor raise ConfigError naming the first of them.
    """
    adapter = spec.state_dict_adapter(spec.model, None)
    loaded = adapter.from_hf(read_hf_state_dict(path))
    expected = model.state_dict()
    for key, tensor in expected.items():
        if key not in loaded:
            raise ConfigError(
                f"model.hf_checkpoint = {path!r} lacks {key!r} that model.flavor = "
                f"{spec.flavor!r} needs: pick the flavor the checkpoint was saved from"
            )
        if tuple(loaded[key].shape) != tuple(tensor.shape):
            raise ConfigError(
                f"model.hf_checkpoint = {path!r}: {key!r} has shape {tuple(loaded[key].shape)} "
                f"but model.flavor = {spec.flavor!r} expects {tuple(tensor.shape)}: "
                "pick the flavor the checkpoint was saved from"
            )
    extra = sorted(set(loaded) - set(expected))
    if extra:
        raise ConfigError(
            f"model.hf_checkpoint = {path!r} has {extra[0]!r}, unknown to model.flavor = "
            f"{spec.flavor!r}: pick the flavor the checkpoint was saved from"
        )
    model.load_state_dict(loaded, strict=True)


def build_model(model: ModelSection, device: torch.device, seed: int = 0) -> nn.Module:
    """The unsharded model of `model` on `device`: HF weights if given, else seeded init."""
    spec = build_spec(model)
    with torch.device("meta"):
        module = spec.model.build()
    module.to_empty(device=device)
    torch.manual_seed(seed)
    with torch.no_grad():
        module.init_states(buffer_device=device)
    if model.hf_checkpoint is not None:
        load_hf_weights(module, spec, model.hf_checkpoint)
    # Cast parameters only: `module.to(dtype)` would also downcast the fp32 RoPE cache buffers.
    for param in module.parameters():
        param.data = param.data.to(getattr(torch, model.dtype))
    return module
