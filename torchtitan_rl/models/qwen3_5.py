"""Qwen3.5's text model on torchtitan's modules, with the Gated DeltaNet recurrence in plain
torch where `fla` (its Triton kernels) is not installed.

    .venv/bin/python -m pytest tests/unit/test_gated_delta.py

torchtitan's `qwen3_5/model.py` imports `fla` when it loads, and runs only `fla`'s kernels and
packed-row convolution; its model always builds a vision encoder. This module:
- imports it with stand-ins for the `fla` names it takes at import (`family()`), each raising
  if called, where `fla` is absent; nothing of them runs: the layers below replace every call;
- `DeltaNet`: torchtitan's `GatedDeltaNet` (its parameters and names) with this project's
  forward: the convolution and the recurrence per document of a packed row, or per row of
  right-padded ones, through `platform.gated_delta_rule()` (gated_delta.py on CPU);
- `TextModel`: torchtitan's `Qwen35Model` without the vision encoder, taking the trainer's
  `attention_masks` (None or `Documents`) for both layer kinds;
- `text_only(config)`: a torchtitan flavor's config as `TextModel`'s;
- `Adapter`: torchtitan's state-dict adapter for HF's text-only checkpoints
  (`Qwen3_5ForCausalLM`: `model.layers.`, per-expert tensors), refusing unknown keys.
"""

import contextlib
import dataclasses
import importlib
import re
import sys
import types
from typing import Any

import torch

from torchtitan_rl.models import gated_delta
from torchtitan_rl.models.moe import local_shard

# The names torchtitan's qwen3_5/model.py imports from fla at module level.
_FLA_NAMES = {
    "fla.modules.conv.triton.ops": ("CausalConv1dFunction",),
    "fla.ops.gated_delta_rule": (
        "chunk_gated_delta_rule",
        "fused_recurrent_gated_delta_rule",
    ),
    "fla.ops.gated_delta_rule.chunk": ("ChunkGatedDeltaRuleFunction",),
    "fla.ops.gated_delta_rule.fused_recurrent": ("FusedRecurrentFunction",),
}


def family() -> types.ModuleType:
    """torchtitan's `qwen3_5` package, imported with stand-ins for `fla` where it is absent
    (removed from `sys.modules` again, so that nothing else takes them for `fla`)."""
    name = "torchtitan.models.qwen3_5"
    if name in sys.modules or _platform().fla_installed():
        return importlib.import_module(name)
    with _fla_stand_ins():
        return importlib.import_module(name)


@contextlib.contextmanager
def _fla_stand_ins():
    def absent(*args, **kwargs):
        raise RuntimeError("fla is not installed: Qwen3.5 runs gated_delta.py's kernels here")

    class AbsentFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *args):
            absent()

    added = []
    for module_name, names in _FLA_NAMES.items():
        parts = module_name.split(".")
        for depth in range(1, len(parts) + 1):
            package = ".".join(parts[:depth])
            if package not in sys.modules:
                sys.modules[package] = types.ModuleType(package)
                added.append(package)
        for attribute in names:
            stand_in = AbsentFunction if attribute[0].isupper() else absent
            setattr(sys.modules[module_name], attribute, stand_in)
    try:
        yield
    finally:
        for package in added:
            del sys.modules[package]


def _classes():
    """`DeltaNet` and `TextModel`, defined once torchtitan's classes are importable."""
    global DeltaNet, TextModel
    if "DeltaNet" in globals():
        return DeltaNet, TextModel
    model = family().model
    from torchtitan.models.common.decoder import Decoder

    from torchtitan_rl.trainer.packed_attention import spans

    class DeltaNet(model.GatedDeltaNet):
        """torchtitan's `GatedDeltaNet` (its parameters, names and initialization) with this
        project's forward: over right-padded rows (`attention_masks` None), each row is one
        sequence; over a packed row (`Documents`), each document is, its convolution and its
        recurrence starting from zeros."""

        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(model.GatedDeltaNet.Config):
            pass

        batch_invariant = False
        """Batch-invariant mode (`batch_invariant.make_linears_invariant` sets it, in the
        trainer and the generator): the recurrent form, token by token, on both sides (the
        generator's prefills too), and the gates through `ops.pointwise`."""

        PROJECTIONS = ("in_proj_q", "in_proj_k", "in_proj_v", "in_proj_z", "in_proj_a", "in_proj_b")
        """The linear layers that read the layer's input, in the order `projected` returns
        their outputs."""

        def __init__(self, config):
            super().__init__(config)
            self.paged = None
            """In the generator: its vLLM state layer (generator/hybrid.py
            `GatedDeltaState`), whose slots hold each request's convolution inputs and
            recurrent state."""
            self.stacked = None
            """In the generator: the PROJECTIONS in one GEMM (generator/packed.py
            `PackedStack`), as vLLM's own model merges them."""

        def forward(self, x_BLD: torch.Tensor, attention_masks=None) -> torch.Tensor:
            L = x_BLD.shape[1]
            qkv_BLC, z_BLC, a_BLH, b_BLH = self.projected(x_BLD)
            convs = (self.conv_q, self.conv_k, self.conv_v)
            weight = torch.cat([local_shard(c.weight) for c in convs])
            A_log, dt_bias = local_shard(self.A_log), local_shard(self.dt_bias)
            H = a_BLH.shape[-1]  # the rank's value heads; its key heads:
            key_heads = (qkv_BLC.shape[-1] - H * self.value_head_dim) // (2 * self.key_head_dim)
            if self.paged is not None:  # vLLM's flat batch of requests, [1, T, D]
                out_THV = torch.ops.torchtitan_rl.gated_delta_paged(
                    qkv_BLC[0],
                    a_BLH[0],
                    b_BLH[0],
                    A_log,
                    dt_bias,
                    weight,
                    self.paged.layer_name,
                    key_heads,
                    self.key_head_dim,
                    self.value_head_dim,
                    self.batch_invariant,
                    self.paged.vllm_kernels,
                )
                return self.output(out_THV[None], z_BLC)
            g_BLH, beta_BLH = self.gates(a_BLH, b_BLH, A_log, dt_bias)
            runs = [(0, L)] if attention_masks is None else spans(attention_masks)
            sequences = []
            for start, end in runs:
                mixed, _ = gated_delta.causal_conv(qkv_BLC[:, start:end], weight)
                q, k, v = gated_delta.heads(
                    mixed, key_heads, self.key_head_dim, self.value_head_dim
                )
                sequences.append((q, k, v, g_BLH[:, start:end], beta_BLH[:, start:end]))
            if self.batch_invariant:  # the generator's form, the row's documents side by side
                outputs = gated_delta.recurrent_side_by_side(sequences)
            else:
                rule = _platform().gated_delta_rule()
                outputs = [rule(*sequence)[0] for sequence in sequences]
            out_BLHV = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)
            return self.output(out_BLHV, z_BLC)

        def projected(self, x_BLD: torch.Tensor) -> tuple[torch.Tensor, ...]:
            """The q|k|v channels (concatenated), z, a and b of the PROJECTIONS; under the
            spec's TP plan (DTensors: the trainer's, an MoE generator's) the rank's heads, as
            local tensors (concatenating the DTensors would gather them)."""
            if self.stacked is not None:
                widths = [getattr(self, name).weight.shape[0] for name in self.PROJECTIONS]
                return self.stacked(x_BLD).split([sum(widths[:3]), *widths[3:]], dim=-1)
            q, k, v, z, a, b = (local_shard(getattr(self, n)(x_BLD)) for n in self.PROJECTIONS)
            return torch.cat([q, k, v], dim=-1), z, a, b

        def gates(self, a_BLH, b_BLH, A_log, dt_bias) -> tuple[torch.Tensor, ...]:
            """Each token's decay g (< 0, fp32) and write strength beta per value head; in
            batch-invariant mode through `ops.pointwise` (rows of H values are narrower than
            ATen's vector loop, whose scalar remainder rounds differently)."""
            from torchtitan_rl.batch_invariant import ops

            pointwise = ops.pointwise if self.batch_invariant else None
            return gated_delta.gates(a_BLH, b_BLH, A_log, dt_bias, pointwise)

        def output(self, out_BLHV: torch.Tensor, z_BLC: torch.Tensor) -> torch.Tensor:
            """The gated norm of the recurrence's outputs and the output projection; under
            the TP plan the norm's declared input layout takes the rank's heads as its
            shards, and the row-parallel output projection sums over the ranks."""
            z_BLHV = z_BLC.unflatten(-1, (-1, self.value_head_dim))
            return self.out_proj(self.norm(out_BLHV, z_BLHV).flatten(2))

    class TextModel(model.Qwen35Model):
        """torchtitan's Qwen3.5 decoder without its vision encoder: text in, logits out. Its
        `forward` takes the trainer's `attention_masks` (None: right-padded rows; `Documents`:
        one packed row) and hands it to both layer kinds."""

        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(model.Qwen35Model.Config):
            vision_encoder: Any = None

            def update_from_config(self, *, config, **kwargs) -> None:
                # torchtitan's fills the vision encoder's sharding plan too.
                Decoder.Config.update_from_config(self, config=config, **kwargs)
                from torchtitan.models.qwen3_5 import sharding

                with _no_vision_plan(sharding):
                    sharding.set_qwen35_sharding_config(
                        self, enable_ep=config.parallelism.expert_parallel_degree > 1
                    )

        def __init__(self, config):
            Decoder.__init__(self, config)
            self.vision_encoder = None
            self.spatial_merge_size = None

        def forward(self, tokens, attention_masks=None, positions=None):
            masks = {"quadratic_attention": attention_masks, "deltanet": attention_masks}
            h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
            for layer in self.layers.values():
                h = layer(h, masks, positions)
            h = self.norm(h) if self.norm is not None else h
            if self._skip_lm_head or self.lm_head is None:
                return h
            return self.lm_head(h)

    globals().update(DeltaNet=DeltaNet, TextModel=TextModel)
    return DeltaNet, TextModel


@contextlib.contextmanager
def _no_vision_plan(sharding):
    plan = sharding._set_vision_encoder_sharding
    sharding._set_vision_encoder_sharding = lambda config: None
    try:
        yield
    finally:
        sharding._set_vision_encoder_sharding = plan


def _platform():
    from torchtitan_rl import platform

    return platform


def text_only(config):
    """torchtitan's Qwen3.5 config `config` as `TextModel`'s: no vision encoder, every Gated
    DeltaNet layer a `DeltaNet`."""
    delta_net, text_model = _classes()
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    fields["vision_encoder"] = None
    text = text_model.Config(**fields)
    for layer in text.layers:
        if layer.delta_net is not None:
            old = layer.delta_net
            layer.delta_net = delta_net.Config(
                **{f.name: getattr(old, f.name) for f in dataclasses.fields(old)}
            )
    return text


# HF's text-only checkpoints (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM) against the
# vision-language ones torchtitan's adapter reads.
_TEXT, _VL = "model.layers.", "model.language_model.layers."
_PER_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")


def adapter_class():
    """The state-dict adapter for `qwen3_5` (a class, as `ModelSpec.state_dict_adapter`)."""
    base = family().state_dict_adapter.Qwen35StateDictAdapter

    class Adapter(base):
        """torchtitan's `Qwen35StateDictAdapter` for HF's text-only checkpoints: names under
        `model.layers.` / `model.embed_tokens` / `model.norm` (not `model.language_model.`),
        experts per expert (`experts.{e}.gate_proj`, ...: what `save_pretrained` writes and
        vLLM reads) rather than fused. torchtitan's skips a key it does not know without a
        word; this one raises, naming it."""

        def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
            out = {}
            for key, value in super().to_hf(state_dict).items():
                key = _text_name(key)
                match = re.fullmatch(
                    r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)", key
                )
                if match is None:
                    out[key] = value
                    continue
                layer, kind = match.groups()
                # torchtitan's fused layouts: gate_up_proj [E, D, 2F], down_proj [E, F, D].
                for e in range(value.shape[0]):
                    prefix = f"model.layers.{layer}.mlp.experts.{e}."
                    if kind == "down_proj":
                        out[prefix + "down_proj.weight"] = value[e].transpose(0, 1)
                    else:
                        gate, up = value[e].chunk(2, dim=-1)
                        out[prefix + "gate_proj.weight"] = gate.transpose(0, 1)
                        out[prefix + "up_proj.weight"] = up.transpose(0, 1)
            return out

        def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
            fused: dict[str, dict[int, dict[str, Any]]] = {}
            vl = {}
            for key, value in hf_state_dict.items():
                match = _PER_EXPERT.fullmatch(key)
                if match is not None:
                    layer, expert, kind = match.groups()
                    fused.setdefault(layer, {}).setdefault(int(expert), {})[kind] = value
                    continue
                vl[_vl_name(key)] = value
            for layer, experts in fused.items():
                order = [experts[e] for e in sorted(experts)]
                # [E, D, 2F] and [E, F, D], as torchtitan's adapter splits them.
                vl[f"{_VL}{layer}.mlp.experts.gate_up_proj"] = torch.stack(
                    [torch.cat([x["gate"], x["up"]]).transpose(0, 1) for x in order]
                )
                vl[f"{_VL}{layer}.mlp.experts.down_proj"] = torch.stack(
                    [x["down"].transpose(0, 1) for x in order]
                )
            unknown = sorted(key for key in vl if not self._knows(key))
            if unknown:
                raise ValueError(
                    f"the checkpoint has tensors a Qwen3.5 text model does not have: "
                    f"{', '.join(_text_name(k) for k in unknown[:5])}"
                    f"{' ...' if len(unknown) > 5 else ''}"
                )
            return super().from_hf(vl)

        def _knows(self, vl_key: str) -> bool:
            abstract = re.sub(r"(\d+)", "{}", vl_key, count=1)
            return abstract in self.from_hf_map or abstract in (
                f"{_VL}{{}}.mlp.experts.gate_up_proj",
                f"{_VL}{{}}.mlp.experts.down_proj",
            )

    return Adapter


def _text_name(key: str) -> str:
    return key.replace("model.language_model.", "model.")


def _vl_name(key: str) -> str:
    return key if key.startswith("lm_head") else key.replace("model.", "model.language_model.", 1)
