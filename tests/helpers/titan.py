"""The tiny checkpoint through torchtitan alone, for tests that compare other readers of it
(transformers, vLLM) with the model the trainer builds."""

import torch

from torchtitan_rl import platform
from torchtitan_rl.config import ModelSection
from torchtitan_rl.trainer.model import build_spec, load_hf_weights


def torchtitan_model(checkpoint: str, flavor: str = "tiny", name: str = "qwen3"):
    """The unsharded `name`/`flavor` loaded through the spec's HF adapter."""
    platform.patch_torchtitan()
    spec = build_spec(ModelSection(name=name, hf_checkpoint=checkpoint, flavor=flavor))
    model = spec.model.build()
    model.init_states()
    load_hf_weights(model, spec, checkpoint)
    return model


def torchtitan_logits(
    checkpoint: str, ids: list[int], flavor: str = "tiny", name: str = "qwen3"
) -> torch.Tensor:
    """[T, V] logits of the unsharded `name`/`flavor` loaded through the spec's HF adapter."""
    model = torchtitan_model(checkpoint, flavor, name)
    tokens_BT = torch.tensor([ids])
    with torch.no_grad():
        return model(tokens_BT, positions=torch.arange(len(ids))[None])[0]
