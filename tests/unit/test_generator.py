"""Generator pieces that need no engine: the plugin entry point. The engine itself:
tests/integration/test_generator.py.

    .venv/bin/python -m pytest tests/unit/test_generator.py
"""


def test_plugin_entry_point_registers_the_architecture():
    from vllm import ModelRegistry
    from vllm.plugins import load_general_plugins

    from torchtitan_rl.generator.plugin import ARCH

    load_general_plugins()  # what every vLLM process does at start: no import of ours needed
    assert ARCH in ModelRegistry.get_supported_archs()
