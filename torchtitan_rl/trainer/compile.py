"""`training.compile`: what torchtitan's per-block torch.compile needs from our attention.

    .venv/bin/python -m pytest tests/integration/test_compile.py

torchtitan compiles each transformer block with `fullgraph=True` (distributed/compile.py).
Dynamo guards on the Python values a graph reads, and the CPU packed kernel
(`sdpa_per_document`) loops over the row's document starts, a host tuple: every new packing
would trace a new graph (measured on the tiny model: one per step) until Dynamo's recompile
limit, then run eager without a word. So the packed kernel runs inside one opaque op,
`torchtitan_rl::packed_attention`, that takes the documents' starts as a tensor: the graph sees
tensors only, the row length becomes a dynamic size after one recompile, and no packing
recompiles after that. The op's backward runs the kernel's forward again under autograd (one
more attention forward per block; the GEMMs around it stay compiled). Shapes: L tokens of a
packed row, N query heads, K key/value heads, H head dim.

CUDA's `varlen` kernel is torch's own varlen op on tensors (its longest-document size turns
dynamic like the row length) and stays as it is.
"""

import functools

import torch
import torch.nn as nn
from torchtitan.models.common.attention import VarlenMetadata

from torchtitan_rl.config.training import refuse_windowed
from torchtitan_rl.trainer import packed_attention
from torchtitan_rl.trainer.attention import DocumentCausalAttention


def compilable_attention(module: nn.Module) -> int:
    """Route every `DocumentCausalAttention` of `module` whose packed kernel reads host values
    through `torchtitan_rl::packed_attention`, in place; returns how many were routed. A model
    with sliding-window layers (gpt-oss, Muse Glimmer) is refused in one line."""
    layers = [a for a in module.modules() if isinstance(a, DocumentCausalAttention)]
    refuse_windowed("this model", [attention.window for attention in layers])
    routed = 0
    for attention in layers:
        kernel = attention.packed
        if kernel is packed_attention.varlen or isinstance(kernel, functools.partial):
            continue  # already tensor-only, or routed
        name = kernel.__name__
        if getattr(packed_attention, name, None) is not kernel:
            raise ValueError(
                f"training.compile: the packed attention kernel {name!r} is not one of "
                "trainer/packed_attention.py's, which the compiled op can name"
            )
        attention.packed = functools.partial(_opaque, kernel=name)
        routed += 1
    return routed


def _opaque(q_1LNH, k_1LNK, v_1LNK, docs, scale=None, enable_gqa=False, *, kernel: str):
    """The kernel's call signature, with only `docs`' starts tensor reaching the op."""
    return torch.ops.torchtitan_rl.packed_attention(
        q_1LNH, k_1LNK, v_1LNK, docs.cu_seq_q, kernel, scale, enable_gqa
    )


def _run(kernel, q_1LNH, k_1LNK, v_1LNK, cu_seq, scale, enable_gqa):
    """`kernel` (a packed_attention function's name) on real tensors, with the documents
    rebuilt from their starts (a host copy: free on CPU, one small copy on CUDA)."""
    starts = tuple(cu_seq.tolist())
    longest = max((b - a for a, b in zip(starts, starts[1:], strict=False)), default=0)
    docs = VarlenMetadata(cu_seq, cu_seq, longest, longest, starts)
    fn = getattr(packed_attention, kernel)
    return fn(q_1LNH, k_1LNK, v_1LNK, docs, scale=scale, enable_gqa=enable_gqa)


@torch.library.custom_op("torchtitan_rl::packed_attention", mutates_args=())
def packed_attention_op(
    q_1LNH: torch.Tensor,
    k_1LNK: torch.Tensor,
    v_1LNK: torch.Tensor,
    cu_seq: torch.Tensor,
    kernel: str,
    scale: float | None,
    enable_gqa: bool,
) -> torch.Tensor:
    """Document-causal attention of one packed row [1, L, N, H], opaque to torch.compile."""
    return _run(kernel, q_1LNH, k_1LNK, v_1LNK, cu_seq, scale, enable_gqa)


@packed_attention_op.register_fake
def _(q_1LNH, k_1LNK, v_1LNK, cu_seq, kernel, scale, enable_gqa):
    return q_1LNH.new_empty((*q_1LNH.shape[:-1], v_1LNK.shape[-1]))


@torch.library.custom_op("torchtitan_rl::packed_attention_backward", mutates_args=())
def packed_attention_backward(
    grad_1LNH: torch.Tensor,
    q_1LNH: torch.Tensor,
    k_1LNK: torch.Tensor,
    v_1LNK: torch.Tensor,
    cu_seq: torch.Tensor,
    kernel: str,
    scale: float | None,
    enable_gqa: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of q, k, v: the kernel's forward again under autograd, then its backward."""
    _, vjp = torch.func.vjp(
        lambda q, k, v: _run(kernel, q, k, v, cu_seq, scale, enable_gqa), q_1LNH, k_1LNK, v_1LNK
    )
    return vjp(grad_1LNH)


@packed_attention_backward.register_fake
def _(grad_1LNH, q_1LNH, k_1LNK, v_1LNK, cu_seq, kernel, scale, enable_gqa):
    return torch.empty_like(q_1LNH), torch.empty_like(k_1LNK), torch.empty_like(v_1LNK)


def _setup_context(ctx, inputs, output):
    q_1LNH, k_1LNK, v_1LNK, cu_seq, kernel, scale, enable_gqa = inputs
    ctx.save_for_backward(q_1LNH, k_1LNK, v_1LNK, cu_seq)
    ctx.options = (kernel, scale, enable_gqa)


def _backward(ctx, grad_1LNH):
    q_1LNH, k_1LNK, v_1LNK, cu_seq = ctx.saved_tensors
    grads = packed_attention_backward(
        grad_1LNH.contiguous(), q_1LNH, k_1LNK, v_1LNK, cu_seq, *ctx.options
    )
    return *grads, None, None, None, None


packed_attention_op.register_autograd(_backward, setup_context=_setup_context)
