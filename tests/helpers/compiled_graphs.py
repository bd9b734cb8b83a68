"""What Dynamo compiled, and what in it reads the device on the host.

    .venv/bin/python -m pytest tests/unit/test_compiled_graphs.py

`recording()` keeps every FX graph Dynamo hands a backend while it is on (vLLM's compiled
decoder, a compiled trainer block), the graph itself, as its backend sees it.
`host_reads(graph)` names the nodes whose value depends on the device's data: `.item()`,
`.tolist()`, `nonzero`, `masked_select`, `unique`, boolean indexing, `repeat_interleave`
without `output_size`. Dynamo (torch 2.13) traces each of them into the graph rather than
failing under `fullgraph=True`, as an unbacked symbol (a value or a size it cannot know before
the data): on a GPU each is a stall in every replay, and vLLM, which traces once with every
guard dropped, freezes any Python it drove (a loop's trip count) at the traced values. Ops
that are opaque to the graph (a custom op with a fake implementation, vLLM's attention) do
their host work inside, out of the graph: they are not reported.

Patches torch's private `OutputGraph.call_user_compiler` (the one seam every backend is
called through, vLLM's included), for the tests only.
"""

import contextlib

import torch.fx as fx
from torch._dynamo.output_graph import OutputGraph
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

# Methods that hand a tensor's data to Python, whatever Dynamo makes of them.
_HOST_METHODS = {"item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__"}


@contextlib.contextmanager
def recording():
    """Yield a list that every graph Dynamo compiles inside the block is appended to."""
    graphs: list[fx.GraphModule] = []
    original = OutputGraph.call_user_compiler

    def call_user_compiler(self, gm, example_inputs):
        graphs.append(gm)
        return original(self, gm, example_inputs)

    OutputGraph.call_user_compiler = call_user_compiler
    try:
        yield graphs
    finally:
        OutputGraph.call_user_compiler = original


def host_reads(graph: fx.GraphModule) -> list[str]:
    """The nodes of `graph` that read the device on the host, '{node}: {target}': a host
    method, or a node whose value brings in an unbacked symbol its inputs do not have (not
    what is then computed from that symbol)."""
    reads = []
    for node in graph.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        method = node.op == "call_method" and node.target in _HOST_METHODS
        inputs = set().union(*(_unbacked(arg) for arg in node.all_input_nodes))
        if method or _unbacked(node) - inputs:
            reads.append(f"{node.name}: {getattr(node.target, '__name__', node.target)}")
    return reads


def _unbacked(node: fx.Node) -> set:
    value = node.meta.get("example_value")
    return set() if value is None else set(free_unbacked_symbols(value))


def summary(graphs: list[fx.GraphModule]) -> dict:
    """{"graphs": how many, "nodes": of each, "host_reads": every graph's, in order}: what a
    world saves for a test to assert on (GraphModules do not pickle)."""
    return {
        "graphs": len(graphs),
        "nodes": [len(graph.graph.nodes) for graph in graphs],
        "host_reads": [read for graph in graphs for read in host_reads(graph)],
    }
