"""The inventory of CUDA-only calls (docs/cuda_contracts.md) is complete: a scan of
torchtitan_rl/ fails on a CUDA-only call it does not list, on a row with no such call left, and
on a row whose contract test does not exist.

    .venv/bin/python -m pytest tests/unit/test_cuda_inventory.py
"""

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

INVENTORY = REPO / "docs" / "cuda_contracts.md"
# What marks a line as CUDA-only: torch.cuda, a device string, NCCL, the kernels and vLLM calls
# made only on CUDA, and every read of the platform switch (each read is a branch).
CUDA_NAMES = {
    "varlen_attn",
    "flash_attn_varlen_func",
    "init_batch_invariance",
    "set_batch_invariance",
    "vllm_can_sleep",
    "device_type",
    "dist_backend",
    "is_cuda",
    "wake_up",
    "is_cpu",
}
CUDA_STRINGS = re.compile(r"\bcuda\b|nccl|VLLM_BATCH_INVARIANT|batch_invariant_ops", re.I)


def cuda_sites(root: Path) -> dict[str, set[str]]:
    """`path: function` -> the CUDA-only names and strings it uses, for every .py under root.
    Docstrings are skipped; a module-level use counts under `path: <module>`."""
    sites: dict[str, set[str]] = {}

    def visit(node, path, scope, docstrings):
        for child in ast.iter_child_nodes(node):
            name = scope
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = child.name if scope == "<module>" else f"{scope}.{child.name}"
            found = None
            if isinstance(child, ast.Attribute):
                chain = ast.unparse(child)
                if chain.startswith("torch.cuda") or child.attr in CUDA_NAMES:
                    found = chain
                elif child.attr == "sleep" and ast.unparse(child.value).endswith("engine"):
                    found = chain
            elif isinstance(child, ast.Name) and child.id in CUDA_NAMES:
                found = child.id
            elif isinstance(child, ast.alias) and child.name.split(".")[-1] in CUDA_NAMES:
                found = child.name
            elif isinstance(child, ast.Constant) and isinstance(child.value, str):
                if id(child) not in docstrings and CUDA_STRINGS.search(child.value):
                    found = repr(child.value)
            if found is not None:
                sites.setdefault(f"{path}: {scope}", set()).add(found)
            visit(child, path, name, docstrings)

    for file in sorted(root.rglob("*.py")):
        tree = ast.parse(file.read_text())
        # Docstrings, field docstrings included: every string that is a statement of its own.
        docstrings = {
            id(node.value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
        }
        visit(tree, file.relative_to(root.parent).as_posix(), "<module>", docstrings)
    return sites


def inventory_rows() -> dict[str, str]:
    """`path: function` -> the contract test named in that row of docs/cuda_contracts.md."""
    rows = {}
    for line in INVENTORY.read_text().splitlines():
        cells = [cell.strip().strip("`") for cell in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("torchtitan_rl/"):
            rows[cells[0]] = cells[3]
    return rows


def test_every_cuda_only_call_is_in_the_inventory_with_a_contract_test():
    sites = cuda_sites(REPO / "torchtitan_rl")
    rows = inventory_rows()
    unlisted = {site: sorted(names) for site, names in sites.items() if site not in rows}
    assert not unlisted, (
        f"CUDA-only calls missing from {INVENTORY.name}: {unlisted}; add a row with the "
        "documented behaviour and a contract test"
    )
    stale = sorted(set(rows) - set(sites))
    assert not stale, f"{INVENTORY.name} lists sites with no CUDA-only call left: {stale}"
    tests = "\n".join(p.read_text() for p in (REPO / "tests" / "unit").glob("test_*.py"))
    for site, test in rows.items():
        names = re.findall(r"test_\w+", test)
        assert names, f"{INVENTORY.name}: {site} names no contract test"
        for name in names:
            assert f"def {name}(" in tests, f"{INVENTORY.name}: {site}: no unit test {name}"


def test_the_scan_sees_a_cuda_call_it_has_not_been_told_of(tmp_path):
    package = tmp_path / "torchtitan_rl"
    package.mkdir()
    (package / "x.py").write_text(
        'def f():\n    """Mentions cuda in a docstring only."""\n    return 1\n\n'
        "def g(t):\n    torch.cuda.synchronize()\n    return t.to('cuda')\n"
    )
    sites = cuda_sites(package)
    assert sites == {"torchtitan_rl/x.py: g": {"torch.cuda.synchronize", "torch.cuda", "'cuda'"}}
