"""Generator: the real vLLM engine serving our torchtitan model, checked against the trainer.

    .venv/bin/python -m pytest tests/unit/test_generator.py

vLLM runs in torchrun subprocesses (one engine per rank, shared by every check of a run):
its CPU worker binds threads, which must not leak into the pytest process.
"""

import torch
from helpers.launch import run_dist


def launch(tmp_path_factory, nproc: int, model: str = "qwen3") -> list[dict]:
    """Run tests/dist/generator_run.py under torchrun, or as a plain process for nproc = 0."""
    out = tmp_path_factory.mktemp(f"generator_{model}_w{nproc}")
    run_dist("generator_run.py", str(out), model, nproc=nproc)
    return [torch.load(out / f"rank{r}.pt") for r in range(max(nproc, 1))]


def test_plugin_entry_point_registers_the_architecture():
    from vllm import ModelRegistry
    from vllm.plugins import load_general_plugins

    from torchtitan_rl.generator.plugin import ARCH

    load_general_plugins()  # what every vLLM process does at start: no import of ours needed
    assert ARCH in ModelRegistry.get_supported_archs()
