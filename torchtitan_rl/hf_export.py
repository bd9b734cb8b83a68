"""HF safetensors export of a policy: its weights (gathered, cast to the HF checkpoint's
dtype) with the config and tokenizer files of the checkpoint the run started from.

    .venv/bin/python -m pytest tests/integration/test_checkpoint.py -k export

What the run writes at the end (checkpoint.export_hf_at_end) and scripts/export_hf.py writes
for any checkpoint (torchtitan_rl/checkpoint.py); vLLM and transformers load the folder.
"""

import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torchtitan_rl import console
from torchtitan_rl.config import ConfigError, ModelSection, read_json
from torchtitan_rl.trainer.lora import is_lora_key
from torchtitan_rl.trainer.model import is_unread_key, mtp_layers, reads_vision

HF_SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "torchtitan.json",
)


def export_hf(
    model_state: dict,
    spec,
    hf_source: str | None,
    tokenizer_dir: str,
    out: Path,
    group: dist.ProcessGroup | None = None,
):
    """Write `model_state` (torchtitan names; DTensors are gathered) as an HF safetensors folder.

    Every rank must call this (gathering is collective); rank 0 writes. config.json and the
    tokenizer files come from the HF checkpoint the run started from, and so do the tensors the
    model does not run (a vision tower, multi-token-prediction layers); weights are cast to its
    config's dtype. The folder appears complete or not at all (written aside, then renamed).
    """
    from safetensors.torch import save_file

    writer = not dist.is_initialized() or dist.get_rank(group) == 0
    full = {}
    for name, tensor in model_state.items():
        # One tensor gathered at a time (a collective); only the writing rank keeps them, as
        # host tensors, so no rank holds the whole model on its device and the others hold none.
        gathered = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if writer:
            full[name] = gathered.detach().cpu()
    if not writer:
        dist.barrier(group=group)
        return
    source = Path(hf_source or tokenizer_dir)
    config_path = source / "config.json"
    if not config_path.is_file():
        raise ConfigError(
            f"checkpoint.export_hf_at_end needs an HF config.json next to the weights; "
            f"{source} has none: set model.hf_checkpoint to the checkpoint the run started from"
        )
    hf_config = read_json(source, "config.json", "model.hf_checkpoint")
    dtype = getattr(torch, hf_config.get("torch_dtype") or hf_config.get("dtype") or "float32")
    adapter = spec.state_dict_adapter(spec.model, None)
    hf_state = {k: v.to(dtype).contiguous() for k, v in adapter.to_hf(full).items()}
    if hf_source:
        hf_state |= _unread_tensors(Path(hf_source), hf_state, hf_config)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(hf_state, tmp / "model.safetensors", metadata={"format": "pt"})
    for name in HF_SIDE_FILES:
        for folder in (source, Path(tokenizer_dir)):
            if (folder / name).is_file():
                shutil.copyfile(folder / name, tmp / name)
                break
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    if dist.is_initialized():
        dist.barrier(group=group)


def _unread_tensors(source: Path, exported: dict, hf_config: dict) -> dict:
    """The source checkpoint's tensors that the model leaves unread (`is_unread_key`: a
    text-only flavor's vision tower, multi-token-prediction layers), as they are: the
    export is then the source's whole model with the trained text tower, as its config.json
    (copied) describes it, and vLLM and transformers load it as they loaded the source."""
    from safetensors import safe_open

    mtp, vision = mtp_layers(exported, hf_config), reads_vision(exported)
    found = {}
    for path in sorted(source.glob("*.safetensors")):
        with safe_open(path, "pt") as shard:
            for key in shard.keys():
                if is_unread_key(key, mtp, vision):
                    found[key] = shard.get_tensor(key)
    return found


def export_policy(trainer, model: ModelSection, out: Path, group=None) -> None:
    """`trainer`'s policy (a PolicyTrainer) as an HF safetensors folder at `out`, with the
    config and tokenizer files of `model`'s checkpoint (every rank of `group`, the trainer
    ranks, calls; rank 0 writes)."""
    with trainer.merged():  # LoRA: the merged weights, without the adapters
        state = {k: v for k, v in trainer.model.state_dict().items() if not is_lora_key(k)}
        export_hf(state, trainer.spec, model.hf_checkpoint, model.tokenizer_dir, out, group)
    if dist.get_rank() == 0:
        console.say(f"exported the policy to {out}")
