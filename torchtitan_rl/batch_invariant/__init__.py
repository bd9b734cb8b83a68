"""Batch-invariant mode: one global switch, set before any model or engine is built.

    .venv/bin/python -m pytest tests/*/test_batch_invariant.py

With it on, the trainer and the generator compute every sampled token's logprob with the same
batch-invariant kernels, so the two agree bit for bit whatever the batch composition:
- CPU (this project's kernels, ops.py): every linear layer (trainer modules and the generator
  wrapper, which then skips its oneDNN-packed copies) pads its rows to a fixed tile; attention
  is `ops.attention` on both sides, the generator reading keys/values from vLLM's paged cache;
  RMSNorm, RoPE and log_softmax are row-invariant as they are. The trainer computes logprobs
  as log_softmax(logits / T), exactly vLLM's processed logprobs. Where a side is tensor
  parallel, every row-parallel linear (its weight split by input columns in the TP plan:
  attention output, MLP down projection) reduces in a canonical order on both sides
  (`reduction_slices`, `ops.partial_products`): a rank of a TP generator or trainer computes
  its block of the slices and the ranks combine them in the same tree.
- CUDA (written, checked against vLLM's source on CPU, not run: no GPU in this project's CI):
  one kernel per op on both sides. vLLM's in-tree batch-invariant kernels, installed once per
  process before either side is built (`platform.enable_batch_invariance`), serve the
  trainer's and the generator's ATen ops alike; the generator's attention is vLLM's
  FLASH_ATTN backend with one split, and the trainer's the same function on its tokens
  (flash.py); the generator's compiled pieces run eagerly, as the trainer's ops do. Dense
  decoders at TP 1 in bf16 (`JobConfig._validate_invariant_cuda` says what else is refused).
"""

import functools
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torchtitan.models.common.feed_forward import FeedForward, SigmoidGatedFeedForward
from torchtitan.protocols.module import Module

from torchtitan_rl.batch_invariant import ops

_enabled = False
_slices = 1
"""The canonical slice count of a row-parallel layer's reduction (`reduction_slices`)."""
_expert_slices = 1
"""The canonical slice count of a routed expert's down projection (`expert_slices`)."""
_checked: set[tuple] = set()  # (dim, heads, head_dim, dtype, threads) found invariant here


def reduction_slices(trainer_tp: int, generator_tp: int) -> int:
    """How many slices a row-parallel layer's reduction runs in: the run's largest tensor-
    parallel degree (1: one GEMM, as without TP). Every degree of the run divides it, so each
    TP rank holds a whole block of slices."""
    return max(trainer_tp, generator_tp)


def expert_slices(slices: int, generator_expert_parallel: bool) -> int:
    """How many slices a routed expert's down projection reduces in: the run's `slices` where
    a TP generator splits every expert's hidden units, 1 where it holds whole experts
    (`generator.parallelism.expert_parallel`), as every trainer does under the mode (an MoE
    trains with EP, not TP): no side splits an expert's reduction, so one GEMM is the same
    on both (measured on Qwen3-MoE at EP with top-4 routing: the 2 slices cost the step 31-34%,
    the experts' GEMMs being tiny)."""
    return 1 if generator_expert_parallel else slices


def enable(slices: int = 1, experts: int | None = None) -> None:
    """Turn the mode on for this process (before building any model or engine); `slices`:
    `reduction_slices` of the run; `experts`: its `expert_slices` (default `slices`)."""
    global _enabled, _slices, _expert_slices
    from torchtitan_rl import platform

    _slices = slices
    _expert_slices = slices if experts is None else experts
    platform.enable_batch_invariance()  # CUDA: vLLM's kernels for both sides
    _enabled = True


def is_enabled() -> bool:
    return _enabled


def slices() -> int:
    """The reduction slices `enable` was given."""
    return _slices


def settings() -> tuple[int, int]:
    """What `enable` was given, (slices, experts): `enable(*settings())` in another process
    (a generator's engine, generator/remote.py) turns the mode on alike."""
    return _slices, _expert_slices


def enable_for(config) -> None:
    """`enable` with the slices of `config`'s (a JobConfig's) layouts."""
    generator = config.generator.parallelism
    slices = reduction_slices(config.parallelism.tp, generator.tensor_parallel_degree)
    enable(slices, expert_slices(slices, generator.expert_parallel))


def uses_own_kernels() -> bool:
    """True where this project's kernels implement the mode (CPU); on CUDA vLLM's in-tree
    batch-invariant kernels do (`platform.enable_batch_invariance`)."""
    from torchtitan_rl import platform

    return _enabled and platform.device_type() == "cpu"


def _invariant_linear_forward(self: nn.Linear, x):
    return ops.linear(x, self.weight, self.bias)


def row_parallel(module: nn.Module) -> bool:
    """Whether `module` is a linear the model's TP plan splits by input columns (weight
    Shard(1): its output a partial sum over the TP ranks), read from torchtitan's sharding
    config, which the trainer and the generator both fill in."""
    from torchtitan.distributed.parallel_dims import MeshAxisName

    config = getattr(module, "_sharding_config", None)
    if not isinstance(module, nn.Linear) or config is None:
        return False
    weight = (config.state_shardings or {}).get("weight")
    return weight is not None and str(weight.axis_types.get(MeshAxisName.TP)) == "S(1)"


def canonical_linear(module: nn.Module, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A row-parallel linear's output under the mode: `ops.partial_products` over slices of
    `module.reduction_width` (whichever of them this rank holds), finished over the ranks by
    `module.tp_combine` (a TP generator's, set by generator/tensor_parallel.py; None where
    the rank holds every slice) or, for a DTensor weight (the trainer's TP), over its mesh
    (`_dtensor_blocks`), then the whole bias once, rounded to x's dtype once."""
    combine = module.tp_combine
    if isinstance(weight, DTensor):
        x, weight, combine = _dtensor_blocks(x, weight)
    y = ops.partial_products(x, weight, module.reduction_width)
    if combine is not None:
        y = combine(y)
    if module.bias is not None:
        y = y + module.bias.float()
    return y.to(x.dtype)


def _dtensor_blocks(
    x: torch.Tensor, weight: DTensor
) -> tuple[torch.Tensor, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """`canonical_linear` on the trainer's TP: this rank's blocks of `x` and `weight`, and
    the combine of the ranks' partial sums. `weight` is split by input columns over a 1-D mesh
    (Shard(1)), `x` by features as the column-parallel layer before left it (Shard(-1); a
    plain tensor is this rank's block). The partials are combined in the tree's order
    (`ops.combine_partials` with DTensor's collectives, which carry the gradients: each rank's
    block gets the whole output's), so the output, replicated, has the bits of one device's
    canonical linear. torchtitan's output redistribution is off for these linears
    (`make_linears_invariant`), as for its own RowParallelLinear; sequence parallelism is off
    under the mode (trainer/parallel.py `layout`)."""
    mesh = weight.device_mesh
    if isinstance(x, DTensor):
        x = x.redistribute(mesh, [Shard(x.ndim - 1)]).to_local()

    def all_reduce(partial: torch.Tensor) -> torch.Tensor:
        return DTensor.from_local(partial, mesh, [Partial()]).redistribute(mesh, [Replicate()])

    def all_gather(partial: torch.Tensor, dim: int) -> torch.Tensor:
        return DTensor.from_local(partial, mesh, [Shard(dim)]).redistribute(mesh, [Replicate()])

    def combine(y: torch.Tensor) -> torch.Tensor:
        return ops.combine_partials(y, mesh.size(), all_reduce, all_gather)

    return x, weight.to_local(), combine


def _canonical_forward(self: nn.Linear, x):
    return canonical_linear(self, x, self.weight)


def invariant_linear(module: nn.Linear, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`module`'s output under the mode with `weight` (LoRA's merged one): canonical where it
    is row-parallel in a run with a TP side, else `ops.linear`; on CUDA `F.linear`, which vLLM's
    kernels serve as they serve the generator's."""
    if getattr(module, "reduction_width", None) is not None:
        return canonical_linear(module, x, weight)
    if not uses_own_kernels():
        return F.linear(x, weight, module.bias)
    return ops.linear(x, weight, module.bias)


def _invariant_capped_forward(self: nn.Linear, x, cap):
    return cap(ops.linear(x, self.weight, self.bias))


def _invariant_gated_forward(self, x):
    return ops.pointwise(torch.sigmoid, self.gate(x)) * FeedForward.forward(self, x)


def make_linears_invariant(model: nn.Module) -> None:
    """Run every nn.Linear of `model` through `ops.linear` (parameters and names unchanged),
    then its soft cap where it has one (Muse Glimmer's head: `logprobs.soft_cap`), and this
    project's MoE experts and routers (models/moe.py: the modules with a
    `batch_invariant` switch) through their batch-invariant kernels. A shared expert's sigmoid
    gate (Qwen3.5-MoE's: one value a token) goes through `ops.pointwise`. With
    `reduction_slices` > 1 each row-parallel linear reduces canonically (`canonical_linear`;
    its bias added once, after the sum), and with `expert_slices` > 1 so does each routed
    expert's down projection (models/moe.py `_canonical`), which a TP generator splits by
    hidden units."""
    from torchtitan_rl.trainer.logprobs import soft_cap

    for module in model.modules():
        if isinstance(module, nn.Linear):
            forward = _invariant_linear_forward
            if (cap := soft_cap(module)) is not None:
                forward = functools.partial(_invariant_capped_forward, cap=cap)
            elif _slices > 1 and row_parallel(module):
                module.reduction_width = module.in_features // _slices
                module.tp_combine = None
                forward = _canonical_forward
                # Its output is final, summed over a TP trainer's ranks in the canonical
                # order (`_dtensor_blocks`): torchtitan then only distributes its weight,
                # as for its own RowParallelLinear (its output no Partial to reduce).
                config = module._sharding_config
                module._sharding_config = type(config)(state_shardings=config.state_shardings)
            module.forward = types.MethodType(forward, module)
        if hasattr(type(module), "batch_invariant"):
            module.batch_invariant = True
            if _expert_slices > 1 and hasattr(type(module), "reduction_width"):  # MoE experts
                module.reduction_width = module.hidden_dim // _expert_slices
        if isinstance(module, SigmoidGatedFeedForward):
            module.forward = types.MethodType(_invariant_gated_forward, module)


class CausalAttention(Module):
    """torchtitan inner attention running `ops.attention`: over (B, L, N, H) right-padded causal
    rows, or over each document of a packed row (`attention_masks` = trainer.attention's
    `Documents`) with positions restarting at 0, so a sequence gets the same bits packed or
    alone. The trainer's side of the generator's paged attention in this mode; on CUDA, the
    same rows or documents through vLLM's flash attention (`platform.invariant_attention`)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        window: int | None = None
        """The layer's sliding window (gpt-oss's sliding layers), None: all keys."""

    def __init__(self, config: Config | None = None):
        super().__init__()
        self.window = (config or self.Config()).window

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks=None, scale=None, **kwargs):
        from torchtitan_rl import platform

        kernel = platform.invariant_attention()  # CUDA: the generator's flash attention
        if kernel is not None:
            return kernel(q_BLNH, k_BLNH, v_BLNH, attention_masks, scale)
        causal = functools.partial(
            _causal, scale=scale, window=self.window, out_transform=kwargs.get("out_transform")
        )
        if attention_masks is not None:
            from torchtitan_rl.trainer.attention import per_document

            return per_document(causal, q_BLNH, k_BLNH, v_BLNH, attention_masks)
        return causal(q_BLNH, k_BLNH, v_BLNH)


def _causal(q_BLNH, k_BLNH, v_BLNH, scale=None, window=None, out_transform=None):
    B, L = q_BLNH.shape[:2]
    positions_BL = torch.arange(L, device=q_BLNH.device).expand(B, L)
    return attend(q_BLNH, k_BLNH, v_BLNH, positions_BL, scale, window, out_transform)


def attend(q_BLNH, k_BSKH, v_BSKH, positions_BL, scale, window=None, out_transform=None):
    """`ops.attention`, then torchtitan's `out_transform` (gpt-oss's sinks) of its output and
    logsumexp: the trainer's and the generator's one routine in this mode."""
    if out_transform is None:
        return ops.attention(q_BLNH, k_BSKH, v_BSKH, positions_BL, scale, window)
    out, lse = ops.attention(q_BLNH, k_BSKH, v_BSKH, positions_BL, scale, window, with_lse=True)
    return out_transform(out, lse)


def use_invariant_attention(model_config) -> None:
    """Make every layer of a torchtitan model config build CausalAttention (before build)."""
    for layer in model_config.layers:
        if getattr(layer, "attention", None) is not None:
            layer.attention.inner_attention = CausalAttention.Config(
                window=getattr(layer.attention, "sliding_window_size", None)
            )


def check_kernels(model_config, dtype: str) -> None:
    """On CPU, check on this machine's threads and ISA that the kernels are invariant at the
    model's width and dtype (`ops.invariance_failures`); one ConfigError line if not.

    Measured here (AVX2 and AVX-512 machines, 1 and 2 threads, fp32 and bf16): they are, and
    1 and 2 threads give the same bits. A BLAS that splits the reduction by row count, or a
    thread count that changes the split, would break that; this check finds it at start.
    """
    if not uses_own_kernels():
        return
    from torchtitan_rl.config import ConfigError
    from torchtitan_rl.models import attention_shape

    shape = attention_shape(model_config.first_attention, model_config.dim)
    heads, head_dim = shape.heads, shape.head_dim
    # A colocated process builds the policy, the reference and the generator: check each
    # shape, dtype and thread count once.
    key = (model_config.dim, heads, head_dim, dtype, torch.get_num_threads())
    if key in _checked:
        return
    failures = ops.invariance_failures(model_config.dim, heads, head_dim, getattr(torch, dtype))
    if failures:
        raise ConfigError(
            f"batch_invariant = true: on this CPU ({torch.backends.cpu.get_cpu_capability()}, "
            f"{torch.get_num_threads()} threads) the batch-invariant kernels are not "
            f"({failures[0]}): set batch_invariant = false, or try OMP_NUM_THREADS=1"
        )
    _checked.add(key)
