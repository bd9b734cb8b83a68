"""A tensor-parallel generator on plain local shards: the spec's own TP plan decides what each
rank holds, then forward runs on plain tensors with vLLM's TP collectives.

    .venv/bin/python -m pytest tests/integration/test_generator.py -k tensor_parallel

DTensor's dispatch costs every op of every layer at every decode step (measured on an H100:
2.5x to 7x a plain layer, eager), and a compiled graph of DTensor code is slower still than
plain tensors (TitanRL's ablation: eager DTensor 0.029x native, plain local tensors 0.91-0.95x).
So once the checkpoint is loaded through the DTensor model (torchtitan's fused-QKV load hooks
and `copy_` keep each rank's shard), `localize` turns every DTensor parameter into a plain
parameter holding the rank's shard (the same storage), removes the redistributions torchtitan
wrapped around each module's forward, and adds what the plan's layouts imply, as vLLM's own
models do:

- a row-parallel linear (weight Shard(1): its input is the rank's heads or hidden units) sums
  its partial output over the ranks: `tensor_model_parallel_all_reduce`;
- the vocabulary-parallel embedding (weight Shard(0); torchtitan's forward masks the ids of
  other ranks' rows) likewise;
- a column-parallel linear (Shard(0)) keeps its output's shard, consumed locally (the
  attention's heads, the MLP's hidden units); the LM head's is gathered in `compute_logits`;
- a Gated DeltaNet layer (Qwen3.5) likewise runs the rank's key and value heads: its input
  projections column-parallel, its depthwise convolution on the rank's channels (Shard(0)),
  its per-head A_log and dt_bias sharded, the state slots of the rank's heads
  (generator/hybrid.py), the output projection row-parallel.

Activations between layers are whole on every rank (no sequence parallelism): nothing depends
on the token count, so the batch needs no padding and the decoder compiles. Weight sync still
sees DTensors (`as_dtensors`: views of the local parameters with the plan's layouts), and
writes each rank's shard in place. Supported where the plan has only these layouts: dense
models with a vocabulary the ranks split evenly and no biases on row-parallel layers (qwen3,
llama3, Muse Glimmer: its embedding's norm runs after the embedding's sum, its attention gate
is column-parallel; Qwen3.5's dense hybrids); others (MoE experts, gpt-oss) keep the DTensor
path, eager.
"""

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

Layout = tuple
"""(device mesh, placements, global shape, global stride) of a sharded weight."""


def supported(spec, tp: int) -> bool:
    """Whether `spec`'s model runs on local shards at `tp` ranks (see the module docstring)."""
    config = spec.model
    if any(getattr(layer, "moe", None) is not None for layer in config.layers):
        return False
    return config.vocab_size % tp == 0 and spec.name in (
        "qwen3",
        "llama3",
        "muse_glimmer",
        "qwen3_5",
    )


def compiles(spec, tp: int) -> bool:
    """Whether the generator's decoder compiles at `tp` ranks: on one rank, or on local shards
    (the DTensor path runs eager). The engine's choice and the wrapper's both read this."""
    return tp == 1 or supported(spec, tp)


def localize(model: nn.Module) -> tuple[dict[str, Layout], list[str]]:
    """Turn the parallelized `model` into plain local shards, in place; returns the layout of
    every weight that was a DTensor, by FQN, and the modules whose output must be summed over
    the ranks (`add_all_reduces`, once any module replacement is done)."""
    local: dict[int, nn.Parameter] = {}  # a tied weight becomes one local parameter
    layouts: dict[str, Layout] = {}
    reduced: list[str] = []
    for module_name, module in model.named_modules():
        module.__dict__.pop("forward", None)  # torchtitan's redistributing wrapper
        placements = {}
        for name, param in list(module._parameters.items()):
            if not isinstance(param, DTensor):
                continue
            fqn = f"{module_name}.{name}" if module_name else name
            layouts[fqn] = (param.device_mesh, param.placements, param.shape, param.stride())
            placements[name] = param.placements
            if id(param) not in local:
                local[id(param)] = nn.Parameter(param.to_local(), requires_grad=False)
            module._parameters[name] = local[id(param)]
        for name, buffer in list(module._buffers.items()):
            if isinstance(buffer, DTensor):
                module._buffers[name] = buffer.to_local()
        if _sums_over_ranks(module_name, module, placements.get("weight")):
            reduced.append(module_name)
    return layouts, reduced


def add_all_reduces(model: nn.Module, names: list[str]) -> None:
    """Sum the output of each named module (as it is now: maybe a packed stand-in) over the
    ranks, with vLLM's all-reduce (a registered op: it compiles)."""
    for name in names:
        model.get_submodule(name).register_forward_hook(_all_reduce_output)


def _sums_over_ranks(name: str, module: nn.Module, placements) -> bool:
    """Whether the module's output is partial: a row-parallel linear or a vocabulary-parallel
    embedding; a column-parallel linear's is the rank's slice; nothing else may be sharded."""
    if placements is None or all(isinstance(p, Replicate) for p in placements):
        return False
    (placement,) = placements  # the TP mesh alone: the generator has no data parallelism
    if isinstance(module, nn.Embedding) and placement == Shard(0):
        return True
    if isinstance(module, nn.Linear) and placement == Shard(1):
        if module.bias is not None:
            raise NotImplementedError(f"{name}: a row-parallel linear with a bias")
        return True
    if isinstance(module, (nn.Linear, nn.Conv1d)) and placement == Shard(0):
        return False  # column-parallel, or a Gated DeltaNet's convolution: the rank's slice
    raise NotImplementedError(f"{name}: {type(module).__name__} sharded as {placement}")


def _all_reduce_output(module, args, output: torch.Tensor) -> torch.Tensor:
    from vllm.distributed import tensor_model_parallel_all_reduce

    return tensor_model_parallel_all_reduce(output)


def gather_vocabulary(logits_TV: torch.Tensor) -> torch.Tensor:
    """The LM head's column-parallel output, the rank's slice of the vocabulary, made whole."""
    from vllm.distributed import tensor_model_parallel_all_gather

    return tensor_model_parallel_all_gather(logits_TV, dim=-1)


def as_dtensors(weights: dict[str, torch.Tensor], layouts: dict[str, Layout]) -> dict:
    """`weights` with each sharded one viewed as its DTensor (the same storage), for weight
    sync, which writes each rank's shard of the whole tensor it gathers."""
    out = dict(weights)
    for name, tensor in weights.items():
        if name in layouts:
            mesh, placements, shape, stride = layouts[name]
            out[name] = DTensor.from_local(tensor, mesh, placements, shape=shape, stride=stride)
    return out
