"""The inspection the engine worlds run on what vLLM compiled (helpers/compiled_graphs.py):
each way tensor code reads the device on the host is found in a graph traced as vLLM traces
(fullgraph, guards dropped), and tensor code alone gives nothing.

    .venv/bin/python -m pytest tests/unit/test_compiled_graphs.py
"""

import pytest
import torch
from helpers.compiled_graphs import host_reads, recording, summary

from torchtitan_rl.batch_invariant import ops


def _scalar(x):
    return x * x.sum().item()


def _list_loop(x):
    return torch.cat([x[:k] for k in x.long().abs().tolist()[:2]])


def _nonzero(x):
    return x[torch.nonzero(x > 0)[:, 0]].sum() + x


def _mask(x):
    return x[x > 0].sum() + x


def _repeat(x):
    return torch.repeat_interleave(x, x.long().abs())


@pytest.mark.parametrize(
    "planted, read",
    [(_scalar, "item"), (_list_loop, "item"), (_nonzero, "nonzero"), (_mask, "getitem")]
    + [(_repeat, "repeat_interleave")],
)
def test_every_planted_host_read_is_found(planted, read):
    torch._dynamo.reset()
    options = {"guard_filter_fn": torch.compiler.skip_all_guards_unsafe}
    with recording() as graphs:
        torch.compile(planted, backend="eager", fullgraph=True, options=options)(torch.randn(6) + 3)
    (graph,) = graphs
    found = host_reads(graph)
    assert found and read in found[0], found
    assert summary(graphs)["host_reads"] == found


def test_tensor_code_and_opaque_ops_read_nothing():
    """Arithmetic, reductions, a dynamic size, and the batch-invariant pointwise op (which
    splits its input on the host inside the op, out of the graph)."""
    torch._dynamo.reset()

    def tensor_code(x_T):
        y_T = ops.pointwise(torch.sigmoid, x_T)
        return (y_T * 2).cumsum(0) + x_T.shape[0]

    x_T = torch.randn(50)
    torch._dynamo.mark_dynamic(x_T, 0)
    with recording() as graphs:
        torch.compile(tensor_code, backend="eager", fullgraph=True)(x_T)
    assert [host_reads(graph) for graph in graphs] == [[]]
    torch._dynamo.reset()
