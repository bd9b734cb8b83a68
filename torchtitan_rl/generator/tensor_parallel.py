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
  (generator/hybrid.py), the output projection row-parallel;
- a row-parallel linear with a bias (gpt-oss's attention output) adds 1 / TP of it on each
  rank (torchtitan's `ScaledBiasRowwiseLinear`), so that the sum adds it once;
- an MoE layer's routed experts, whose output is summed over the ranks. The router is
  replicated: every rank routes every token alike. The plan's default shards each expert's
  hidden units (w1, w3 Shard(1); w2 Shard(2); gpt-oss's output bias 1 / TP per rank, as
  torchtitan's forward adds it): each rank runs every routed row over its slice, as a dense
  MLP's TP does. With `generator.parallelism.expert_parallel` each rank holds E / TP whole
  experts (Shard(0)) and `RankExperts` dispatches: every rank sorts all T * K routed rows, its
  experts' first, runs its experts over theirs, and gives 0 for the others' (no all-to-all:
  every rank holds every token); under batch-invariant mode the routed rows themselves are
  summed over the ranks and each token's experts added as on one device (`RankExperts`).
  Shared experts are a dense MLP's column/row-parallel pair.

Activations between layers are whole on every rank (no sequence parallelism): nothing depends
on the token count, so the batch needs no padding and the decoder compiles. Weight sync still
sees DTensors (`as_dtensors`: views of the local parameters with the plan's layouts), and
writes each rank's shard in place. Every family's plan has only these layouts (Muse
Glimmer's embedding norm runs after the embedding's sum, its attention gate is
column-parallel, its vision encoder's layers are column/row pairs as the decoder's); a
vocabulary the ranks do not split evenly keeps the DTensor path, eager, and the engine says
so (`why_not_local`).
"""

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torchtitan.models.common.linear import ScaledBiasRowwiseLinear
from torchtitan.models.common.moe import GroupedExperts
from torchtitan.models.common.token_dispatcher import LocalDispatchMetadata, LocalTokenDispatcher

from torchtitan_rl.batch_invariant import ops

Layout = tuple
"""(device mesh, placements, global shape, global stride) of a sharded weight."""


def why_not_local(spec, tp: int) -> str:
    """Why `spec`'s model cannot run on local shards at `tp` ranks ('' where it can)."""
    vocab = spec.model.vocab_size
    if tp > 1 and vocab % tp:
        return (
            f"its vocabulary of {vocab} does not split evenly over "
            f"generator.parallelism.tensor_parallel_degree = {tp} ranks"
        )
    return ""


def supported(spec, tp: int) -> bool:
    """Whether `spec`'s model runs on local shards at `tp` ranks (see the module docstring),
    so that its decoder compiles (one rank always does; the DTensor path runs eager). The
    engine's choice and the wrapper's both read this."""
    return not why_not_local(spec, tp)


def localize(model: nn.Module) -> tuple[dict[str, Layout], list[str]]:
    """Turn the parallelized `model` into plain local shards, in place; returns the layout of
    every weight that was a DTensor, by FQN, and the modules whose output must be summed over
    the ranks (`add_all_reduces`, once any module replacement is done)."""
    local: dict[int, nn.Parameter] = {}  # a tied weight becomes one local parameter
    layouts: dict[str, Layout] = {}
    reduced: list[str] = []
    for module_name, module in list(model.named_modules()):
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
        if isinstance(module, GroupedExperts):
            routed_name = module_name.rpartition(".")[0]
            if _local_experts(model.get_submodule(routed_name), layouts, module_name):
                reduced.append(routed_name)
        elif _sums_over_ranks(module_name, module, placements.get("weight")):
            reduced.append(module_name)
    return layouts, reduced


@dataclass(frozen=True, kw_only=True)
class RankDispatchMetadata(LocalDispatchMetadata):
    mine_N: torch.Tensor
    """Whether each sorted routed row is one of this rank's experts'."""
    order_N: torch.Tensor
    """Each sorted routed row's place among the T * K (token, slot) rows."""
    expert_ids_N: torch.Tensor
    """The routed rows' experts, in (token, slot) order."""
    scores_N: torch.Tensor
    """The routed rows' scores, in (token, slot) order."""


class RankExperts(LocalTokenDispatcher):
    """Expert-parallel dispatch on local shards: every rank holds all T tokens and experts
    `first` to `first + count`. Dispatch sorts the T * K routed rows by expert, this rank's
    experts' first (the rest after them, in any order), and hands the experts their counts;
    combine scores and sums this rank's rows and gives 0 for the rest (rows the experts did
    not compute: grouped_mm leaves them unwritten). The routed output is then summed over the
    ranks. Fixed shapes, tensor code: it compiles.

    Under batch-invariant mode (`sum_rows` set by `add_all_reduces`) a token's experts are
    added as on one device instead: each rank puts its experts' rows in their (token, slot)
    places, 0 in the others' (`rows_in_place`); `sum_rows` (vLLM's all-reduce) adds each row
    to zeros only, exact in any order; then every rank weighs and adds a token's experts in
    the one-device dispatcher's order, by expert (`combine_whole`). Summing the ranks' combined
    outputs instead adds a token's experts in another association once it has more than 2 of
    them (gpt-oss routes 4, Qwen3-MoE and DeepSeek-V3 8). It costs an all-reduce of the T * K
    routed rows, not the T tokens."""

    sum_rows = None
    """The sum over the ranks of `rows_in_place` (batch-invariant mode); None: combine, then
    the module's output is summed over the ranks."""

    def __init__(self, num_experts: int, top_k: int, first: int, count: int):
        super().__init__(LocalTokenDispatcher.Config(num_experts=num_experts, top_k=top_k))
        self.first, self.count = first, count

    def mine(self, expert_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(each id as this rank's expert index, whether it is one of this rank's experts);
        `PackedExperts` reads it too."""
        local = expert_ids - self.first
        return local, (local >= 0) & (local < self.count)

    def dispatch(self, x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E):
        expert_ids_N, scores_N = topk_expert_ids_TK.reshape(-1), topk_scores_TK.reshape(-1)
        local_N, mine_N = self.mine(expert_ids_N)
        order_N = torch.argsort(torch.where(mine_N, local_N, self.count), stable=True)
        metadata = RankDispatchMetadata(
            token_indices_experts_sorted_N=order_N // self.top_k,
            topk_scores_experts_sorted_N=scores_N[order_N],
            mine_N=mine_N[order_N],
            order_N=order_N,
            expert_ids_N=expert_ids_N,
            scores_N=scores_N,
        )
        counts_e = num_local_tokens_per_expert_E[self.first : self.first + self.count]
        return x_TD[metadata.token_indices_experts_sorted_N], counts_e, metadata

    def combine(self, routed_output_RD, metadata, x_TD):
        if self.sum_rows is not None:
            rows_ND = self.sum_rows(self.rows_in_place(routed_output_RD, metadata))
            return self.combine_whole(rows_ND, metadata, x_TD)
        mine_R1 = metadata.mine_N[:, None]
        return super().combine(torch.where(mine_R1, routed_output_RD, 0), metadata, x_TD)

    def rows_in_place(self, routed_output_RD, metadata) -> torch.Tensor:
        """This rank's experts' output rows at their (token, slot) places, 0 elsewhere."""
        mine_RD = torch.where(metadata.mine_N[:, None], routed_output_RD, 0)
        return torch.zeros_like(mine_RD).index_copy(0, metadata.order_N, mine_RD)

    def combine_whole(self, rows_ND, metadata, x_TD) -> torch.Tensor:
        """Every routed row (summed over the ranks) weighed and added to its token by the
        one-device dispatcher's order (torchtitan's stable sort by expert)."""
        by_expert_N = torch.argsort(metadata.expert_ids_N, stable=True)
        whole = LocalDispatchMetadata(
            token_indices_experts_sorted_N=by_expert_N // self.top_k,
            topk_scores_experts_sorted_N=metadata.scores_N[by_expert_N],
        )
        return super().combine(rows_ND[by_expert_N], whole, x_TD)


def _local_experts(routed: nn.Module, layouts: dict, experts_name: str) -> bool:
    """Make an MoE layer's routed experts run on the rank's shard of their weights; returns
    whether their output is partial (sharded: summed over the ranks)."""
    prefix = experts_name + "."
    shards = [
        layout
        for fqn, layout in layouts.items()
        if fqn.startswith(prefix) and any(isinstance(p, Shard) for p in layout[1])
    ]
    if not shards:  # replicated experts: every rank computes the whole output
        return False
    old = routed.token_dispatcher
    whole = [layout for layout in shards if Shard(0) in layout[1]]
    mesh, _, shape, _ = (whole or shards)[0]
    if whole:  # whole experts over the ranks
        count = shape[0] // mesh.size()
        first = mesh.get_local_rank() * count
        routed.token_dispatcher = RankExperts(old.num_experts, old.top_k, first, count)
    else:  # every expert's hidden units over the ranks: the plain local dispatch
        config = LocalTokenDispatcher.Config(num_experts=old.num_experts, top_k=old.top_k)
        routed.token_dispatcher = LocalTokenDispatcher(config)
        if hasattr(routed.inner_experts, "tp_degree"):  # gpt-oss's output bias, 1 / TP each
            routed.inner_experts.tp_degree = mesh.size()
    return True


def add_all_reduces(model: nn.Module, names: list[str]) -> None:
    """Sum the output of each named module (as it is now: maybe a packed stand-in) over the
    ranks, with vLLM's all-reduce (a registered op: it compiles). A row-parallel linear of
    batch-invariant mode (`batch_invariant.canonical_linear`), or routed experts split by
    hidden units (models/moe.py `_canonical`), instead finishes its canonical reduction over
    the ranks itself, in fp32, before its bias and its rounding."""
    for name in names:
        module = model.get_submodule(name)
        # An MoE layer's routed experts reduce canonically like a linear (under the mode,
        # which packs nothing).
        reducing = getattr(module, "inner_experts", module)
        dispatcher = getattr(module, "token_dispatcher", None)
        if isinstance(dispatcher, RankExperts) and getattr(reducing, "batch_invariant", False):
            dispatcher.sum_rows = _all_reduce  # whole experts: each row finished on its rank
        elif getattr(reducing, "reduction_width", None) is not None:
            reducing.tp_combine = _combine_partials
        else:
            module.register_forward_hook(_all_reduce_output)


def _combine_partials(y: torch.Tensor) -> torch.Tensor:
    from vllm.distributed import (
        get_tensor_model_parallel_world_size,
        tensor_model_parallel_all_gather,
        tensor_model_parallel_all_reduce,
    )

    return ops.combine_partials(
        y,
        get_tensor_model_parallel_world_size(),
        tensor_model_parallel_all_reduce,
        tensor_model_parallel_all_gather,
    )


def _sums_over_ranks(name: str, module: nn.Module, placements) -> bool:
    """Whether the module's output is partial: a row-parallel linear or a vocabulary-parallel
    embedding; a column-parallel linear's is the rank's slice; nothing else may be sharded."""
    if placements is None or all(isinstance(p, Replicate) for p in placements):
        return False
    (placement,) = placements  # the TP mesh alone: the generator has no data parallelism
    if isinstance(module, nn.Embedding) and placement == Shard(0):
        return True
    if isinstance(module, nn.Linear) and placement == Shard(1):
        if module.bias is not None and not isinstance(module, ScaledBiasRowwiseLinear):
            raise NotImplementedError(f"{name}: a row-parallel linear with a bias")
        return True
    if isinstance(module, (nn.Linear, nn.Conv1d)) and placement == Shard(0):
        return False  # column-parallel, or a Gated DeltaNet's convolution: the rank's slice
    raise NotImplementedError(f"{name}: {type(module).__name__} sharded as {placement}")


def _all_reduce_output(module, args, output: torch.Tensor) -> torch.Tensor:
    return _all_reduce(output)


def _all_reduce(t: torch.Tensor) -> torch.Tensor:
    from vllm.distributed import tensor_model_parallel_all_reduce

    return tensor_model_parallel_all_reduce(t)


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
