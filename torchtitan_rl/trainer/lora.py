"""LoRA on the policy: torchtitan's LoRA converter, and the merged weights others see.

    .venv/bin/python -m pytest tests/*/test_lora.py

The trainer's model config goes through torchtitan's `LoRAConverter` before it is built: each
target linear becomes a LoRALinear (base weight frozen, adapters `lora_a` [r, in] and
`lora_b` [out, r], B zero at start), every other parameter is frozen, so the optimizer holds
only adapters. The generator and HF exports run the plain model: they get, for each adapted
linear, the merged weight W + s B A (s = alpha / r), computed where it is needed (`Merged`),
never stored beside the trainer's weights.

In batch-invariant mode the trainer computes each adapted linear as x (W + s B A)^T, the
generator's merged weight, instead of x W^T + s (x A^T) B^T: the two differ in the last bits,
so only the merged form gives the generator's logprobs bit for bit. `merge` is the one
definition every side runs; its B A is row-invariant (ops.linear), so the rows a rank merges
from its FSDP shard equal the same rows of the trainer's whole merge.
"""

import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from torchtitan_rl import batch_invariant
from torchtitan_rl.batch_invariant import ops
from torchtitan_rl.config import LoRASection

# torchtitan module names of the linears each lora.target adapts (fused QKV: one wqkv).
TARGETS = {
    "attention": ("wqkv", "wo"),
    "mlp": ("w1", "w2", "w3"),
    "all": ("wqkv", "wo", "w1", "w2", "w3"),
}


def convert(model_config, lora: LoRASection):
    """`model_config` with LoRA adapters on `lora.target`'s linears (before build)."""
    from torchtitan.components.lora import LoRAConverter

    converter = LoRAConverter.Config(
        rank=lora.rank, alpha=lora.alpha, target_modules=list(TARGETS[lora.target])
    ).build()
    return converter.convert(model_config)


def is_lora_key(name: str) -> bool:
    """Whether a state-dict key or parameter name is a LoRA adapter's."""
    return ".lora_a." in name or ".lora_b." in name


def adapted_modules(model: nn.Module, prefix: str = "") -> dict[str, nn.Module]:
    """FQN (without `prefix`, e.g. activation checkpointing's) -> each LoRALinear of `model`.

    torchtitan creates the LoRA classes at run time; they are the modules with a scaling."""
    return {
        name.replace(prefix, ""): module
        for name, module in model.named_modules()
        if hasattr(module, "_lora_scaling")
    }


def merge(
    weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float
) -> torch.Tensor:
    """W + scale * B A for weight [O, I], lora_a [r, I], lora_b [O, r], in their dtype.

    Row o depends only on row o of W and B (ops.linear, in any mode: the rows are padded, a
    negligible cost at rank r), so a shard of rows merges to the same bits as those rows of
    the whole, and a sync, an export and an offline export of a checkpoint agree bit for bit."""
    return weight + scale * ops.linear(lora_b, lora_a.t())


def _merged_forward(self, x):
    merged = merge(self.weight, self.lora_a.weight, self.lora_b.weight, self._lora_scaling)
    return batch_invariant.invariant_linear(self, x, merged)


def use_merged_forward(model: nn.Module) -> None:
    """Batch-invariant mode: every LoRALinear of `model` computes with its merged weight."""
    for module in adapted_modules(model).values():
        module.forward = types.MethodType(_merged_forward, module)


@dataclass(frozen=True, slots=True)
class Merged:
    """The merged weight of one adapted linear, as a weight-sync source: computed per bucket
    from the trainer's live (sharded) parameters, in the receiver's dtype."""

    weight: torch.Tensor
    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scale: float

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def full(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole merged weight (gathers DTensors: every rank of their mesh calls it)."""
        weight, lora_a, lora_b = (_full(t, dtype) for t in (self.weight, self.lora_a, self.lora_b))
        return merge(weight, lora_a, lora_b, self.scale)

    def local(self, dtype: torch.dtype) -> torch.Tensor:
        """This rank's FSDP rows of the merged weight: its rows of W and B (both Shard(0) over
        the same mesh, so the same rows) with the whole A (r x I, gathered: a collective)."""
        assert self.weight.placements == self.lora_b.placements == (Shard(0),)
        weight = self.weight.to_local().to(dtype)
        lora_b = self.lora_b.to_local().to(dtype)
        return merge(weight, _full(self.lora_a, dtype), lora_b, self.scale)


def _full(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(tensor, DTensor):
        return tensor.to(dtype).full_tensor()
    return tensor.detach().to(dtype)


def sync_sources(
    params: dict[str, nn.Parameter], modules: dict[str, nn.Module]
) -> dict[str, "torch.Tensor | Merged"]:
    """What the plain model's parameter of each name gets from a LoRA policy: the parameter
    itself, or for an adapted linear's weight its `Merged` (adapter parameters omitted)."""
    sources: dict[str, torch.Tensor | Merged] = {}
    for name, param in params.items():
        if is_lora_key(name):
            continue
        owner, _, leaf = name.rpartition(".")
        if owner in modules and leaf == "weight":
            module = modules[owner]
            sources[name] = Merged(
                param,
                params[f"{owner}.lora_a.weight"],
                params[f"{owner}.lora_b.weight"],
                module._lora_scaling,
            )
        else:
            sources[name] = param
    return sources


@contextmanager
def merged_in_place(sources: dict[str, "torch.Tensor | Merged"]) -> Iterator[None]:
    """Within: each adapted linear's weight holds its merged weight (fp32, for an export's
    state dict); after: the exact bits it held before. Every rank enters (gathers A)."""
    saved = []
    with torch.no_grad():
        for source in sources.values():
            if isinstance(source, Merged):
                weight = source.weight
                if not isinstance(weight, DTensor):
                    merged, local = source.full(weight.dtype), weight
                elif weight.placements == (Shard(0),):  # FSDP
                    merged, local = source.local(weight.dtype), weight.to_local()
                else:  # TP, HSDP: this rank's part of the whole merged weight
                    whole = source.full(weight.dtype)
                    merged = distribute_tensor(whole, weight.device_mesh, weight.placements)
                    merged, local = merged.to_local(), weight.to_local()
                saved.append((local, local.clone()))
                local.copy_(merged)
    try:
        yield
    finally:
        with torch.no_grad():
            for local, original in saved:
                local.copy_(original)
