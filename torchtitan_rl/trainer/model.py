"""Model specs with this platform's attention, and sharded loading of HF checkpoints.

.venv/bin/python -m pytest tests/unit/test_model.py
"""

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from safetensors import SafetensorError, safe_open
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torchtitan.protocols.model_spec import ModelSpec

from torchtitan_rl import batch_invariant, platform
from torchtitan_rl.config import ConfigError, ModelSection, read_json
from torchtitan_rl.models import model_spec
from torchtitan_rl.models.moe import NOT_IN_HF
from torchtitan_rl.trainer.lora import is_lora_key

# HF tensors that carry no weights of ours (recomputed buffers).
_IGNORED_HF_SUFFIXES = (".rotary_emb.inv_freq",)


def build_spec(model: ModelSection) -> ModelSpec:
    """The model spec of `model.name`/`model.flavor` with this platform's attention."""
    spec = model_spec(model.name, model.flavor)
    platform.use_platform_attention(spec.model, model.dtype)
    if batch_invariant.is_enabled():  # the generator's attention (on CUDA its flash kernel)
        batch_invariant.use_invariant_attention(spec.model)
    return spec


# The config fields an error about a checkpoint names: its folder and its flavor.
STUDENT = ("model.hf_checkpoint", "model.flavor")


def read_hf_shapes(path: str, field: str = STUDENT[0]) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of every *.safetensors file in `path`, from headers only; a file
    that is cut short or damaged is a ConfigError naming it and the config `field` that points
    at `path` (the trainer and the generator both check the files here before loading them)."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{field} = {path!r} has no *.safetensors files")
    _check_shards(path, {file.name for file in files}, field)
    shapes = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for key in f.keys():
                    shapes[key] = tuple(f.get_slice(key).get_shape())
        except SafetensorError as e:
            # safe_open checks the header and that the data it lists fills the file, so a
            # file cut short (an interrupted download) fails here, before any tensor is read.
            reason = str(e).removeprefix("Error while deserializing header: ")
            raise ConfigError(
                f"{field} = {path!r}: {file.name} is damaged ({reason}; "
                f"{file.stat().st_size} bytes): download it again"
            ) from None
        except OSError as e:
            raise ConfigError(
                f"{field} = {path!r}: cannot read {file.name} ({e.strerror})"
            ) from None
    return shapes


def _check_shards(path: str, present: set[str], field: str) -> None:
    """A sharded checkpoint's index (what vLLM's loader follows) is whole and every shard it
    lists is there: a shard missing from a download is named, not a tensor it would hold."""
    index = "model.safetensors.index.json"
    if not (Path(path) / index).is_file():
        return
    weight_map = read_json(path, index, field).get("weight_map")
    if not isinstance(weight_map, dict):
        raise ConfigError(f"{field} = {path!r}: {index} has no weight_map: download it again")
    listed = set(weight_map.values())
    if missing := sorted(listed - present):
        raise ConfigError(
            f"{field} = {path!r} lacks {missing[0]}, one of the {len(listed)} "
            f"shards {index} lists ({len(missing)} missing): download them again"
        )


def check_hf_checkpoint(
    path: str,
    expected: dict[str, tuple[int, ...]],
    flavor: str,
    fields: tuple[str, str] = STUDENT,
) -> None:
    """Raise ConfigError naming the first tensor whose name or shape differs from `expected`
    (`fields`: the config fields of the folder and the flavor, for the message)."""
    field, flavor_field = fields
    found = read_hf_shapes(path, field)
    if quantized := sorted(key for key in found if key.endswith(("_blocks", "_scales"))):
        raise ConfigError(
            f"{field} = {path!r} is MXFP4-quantized ({quantized[0]!r}, as the "
            f"released gpt-oss checkpoints): dequantize it to bf16 first (docs/moe.md, gpt-oss)"
        )
    if quantized := sorted(key for key in found if key.endswith("weight_scale_inv")):
        raise ConfigError(
            f"{field} = {path!r} is FP8-quantized ({quantized[0]!r}, as the released "
            "DeepSeek-V3 and Kimi K2): convert it to bf16 first (docs/moe.md, DeepSeek-V3)"
        )
    mtp = mtp_layers(expected, read_json(path, "config.json", field))
    vision = reads_vision(expected)
    found = {key: shape for key, shape in found.items() if not is_unread_key(key, mtp, vision)}
    fix = "pick the flavor the checkpoint was saved from"
    for key, shape in expected.items():
        if key not in found:
            raise ConfigError(
                f"{field} = {path!r} lacks {key!r} that {flavor_field} = {flavor!r} needs: {fix}"
            )
        if found[key] != shape:
            raise ConfigError(
                f"{field} = {path!r}: {key!r} has shape {found[key]} but "
                f"{flavor_field} = {flavor!r} expects {shape}: {fix}"
            )
    extra = [
        key
        for key in sorted(set(found) - set(expected))
        if not key.endswith(_IGNORED_HF_SUFFIXES)
        # A tied model keeps one embedding; checkpoints may still store lm_head.
        and not (key == "lm_head.weight" and "model.embed_tokens.weight" in expected)
    ]
    if extra:
        raise ConfigError(
            f"{field} = {path!r} has {extra[0]!r}, unknown to {flavor_field} = {flavor!r}: {fix}"
        )


def mtp_layers(expected, config) -> range:
    """The decoder-layer indices of a checkpoint's multi-token-prediction layers (`config`, its
    config.json, says how many: `num_nextn_predict_layers`): the layers right past the model's
    (DeepSeek-V3 stores its one as `model.layers.61`), which the model, trained and served
    without them, neither reads nor writes. `expected`: the model's HF tensor names."""
    layers = sum(name.endswith(".input_layernorm.weight") for name in expected)
    return range(layers, layers + (config.get("num_nextn_predict_layers") or 0))


VISION_TOWER = ("model.vision_tower.", "model.vision_adapter.", "model.vision_projection.")
"""Where a vision-language checkpoint (Muse Glimmer's) keeps its vision tower, beside the text
tower under `model.language_model.`. A text-only flavor runs the text tower alone; a vision
flavor (`tiny_vl`, `debugmodel_mm`, `30B_mm`) reads the tower too."""


def reads_vision(names) -> bool:
    """Whether a model whose HF tensor names are `names` has a vision tower."""
    return any(name.startswith(VISION_TOWER) for name in names)


def is_unread_key(key: str, mtp: range, vision: bool = False) -> bool:
    """Whether the model leaves HF tensor `key` unread: one of the decoder layers `mtp`
    (`mtp_layers`), or, for a model without a vision tower (not `vision`), the tower's."""
    parts = key.split(".")
    in_mtp = parts[:2] == ["model", "layers"] and parts[2].isdigit() and int(parts[2]) in mtp
    return in_mtp or (not vision and key.startswith(VISION_TOWER))


def hf_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape of the whole model (a sharded state dict names only this rank's
    experts: the adapter splits an expert-sharded tensor into the experts it holds)."""
    with torch.device("meta"):
        state = spec.model.build().state_dict()
    adapter = spec.state_dict_adapter(spec.model, None)
    hf_state = adapter.to_hf({k: v for k, v in state.items() if not is_lora_key(k)})
    return {k: tuple(v.shape) for k, v in hf_state.items()}


def load_hf_weights(
    model: nn.Module, spec: ModelSpec, path: str, group=None, fields: tuple[str, str] = STUDENT
) -> None:
    """Load the HF checkpoint at `path` into `model` (plain or DTensor parameters), sharded.

    The spec's adapter maps our state dict to HF names; DCP's HF reader then fills each rank's
    shards from the safetensors files, reading only what the rank holds. `group`: the ranks
    that load together (default: the world). `fields`: the config fields of the folder and
    the flavor, which an error names.
    """
    adapter = spec.state_dict_adapter(spec.model, None)
    # LoRA adapters are not in an HF checkpoint: they keep their initial values (B = 0); nor
    # is the routers' load-balancing bias (0, as HF's Qwen3-MoE routes).
    state = {k: v for k, v in model.state_dict().items() if not is_lora_key(k)}
    hf_state = adapter.to_hf(state)
    check_hf_checkpoint(path, hf_shapes(spec), spec.flavor, fields)
    dcp.load(hf_state, storage_reader=adapter.get_hf_storage_reader(path), process_group=group)
    loaded = set_model_state_dict(
        model, adapter.from_hf(hf_state), options=StateDictOptions(strict=False)
    )
    missing = [k for k in loaded.missing_keys if not is_lora_key(k) and not k.endswith(NOT_IN_HF)]
    if missing or loaded.unexpected_keys:
        raise ConfigError(
            f"{fields[0]} = {path!r} does not fill the model: missing "
            f"{missing[:3]}, unexpected {loaded.unexpected_keys[:3]}"
        )
