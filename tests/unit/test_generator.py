"""Generator pieces that need no engine: the plugin entry point, vLLM's token ranks. The
engine itself: tests/integration/test_generator.py.

    .venv/bin/python -m pytest tests/unit/test_generator.py
"""

import torch


def test_plugin_entry_point_registers_the_architecture():
    from vllm import ModelRegistry
    from vllm.plugins import load_general_plugins

    from torchtitan_rl.generator.plugin import ARCH

    load_general_plugins()  # what every vLLM process does at start: no import of ours needed
    assert ARCH in ModelRegistry.get_supported_archs()


def test_sampled_tokens_are_ranked_as_vllm_ranks_them_without_compiling(monkeypatch):
    from vllm.v1.sample import sampler

    from torchtitan_rl.generator import engine

    compiled = sampler.batched_count_greater_than
    monkeypatch.setattr(sampler, "batched_count_greater_than", compiled)  # restored after
    engine._rank_sampled_tokens_eagerly()
    assert sampler.batched_count_greater_than is engine._count_at_least
    g = torch.Generator().manual_seed(0)
    logprobs_NV = torch.randn(6, 50, generator=g).log_softmax(-1)
    picked_N1 = logprobs_NV.gather(-1, torch.randint(0, 50, (6, 1), generator=g))
    # vLLM's own function, uncompiled: the same counts.
    original = compiled._torchdynamo_orig_callable
    assert torch.equal(
        engine._count_at_least(logprobs_NV, picked_N1), original(logprobs_NV, picked_N1)
    )
