"""WeightSync: bitwise in-place copies, fresh logprobs, no stale KV, clear errors, bounded buckets.

    .venv/bin/python -m pytest tests/integration/test_weight_sync.py

The end-to-end checks run tests/dist/engine_run.py (real FSDP trainer, real vLLM engine per
rank) under torchrun with 2 processes and as a plain process; the unit tests of the copy logic
are in tests/unit/test_weight_sync.py.
"""

import pytest
import torch
import torch.nn as nn
from helpers.launch import run_dist


@pytest.fixture(
    params=[
        pytest.param(name, marks=pytest.mark.shares(name))
        for name in ("engine_two_ranks", "engine_plain")
    ],
    ids=["torchrun-2", "plain"],
)
def ranks(request) -> list[dict]:
    """What each rank measured with the tiny Qwen3: on 2 torchrun ranks (whose engines
    test_generator.py shares), in a plain process (tests/dist/engine_run.py)."""
    return [r["weight_sync"] for r in request.getfixturevalue(request.param)]


def test_every_parameter_is_bitwise_the_trainers_after_sync(ranks):
    for r in ranks:
        assert r["stale_params_before_sync"] == r["num_params"] == 20  # the step changed all
        assert r["mismatched_after_sync"] == []
        assert r["version"] == 7  # the version sent took hold on the generator


def test_next_generation_samples_from_the_new_weights(ranks):
    for r in ranks:
        assert r["diff_before_step"] <= 1e-5
        assert r["diff_long"] <= 1e-5
        assert r["diff_short"] <= 1e-5


def test_prefix_cache_would_serve_stale_kv_without_the_reset(ranks):
    # Same copy, no cache reset: the 150-token prompt's first block keeps old-weight KV.
    for r in ranks:
        assert r["diff_stale_cache"] > 1e-2


def test_sync_stats(ranks):
    for r in ranks:
        stats = r["stats"]
        # Every fp32 parameter once (the tied embedding once).
        assert stats.bytes == r["generator_bytes"] == 1217536
        assert stats.seconds > 0 and stats.gb_per_s > 0
        assert stats.version == 7  # the version sent
        # 0.1 MiB buckets, or one larger parameter (256 x 128 fp32 = 128 KiB) alone. Two ranks
        # on this host gather through shared memory: one slot per rank of half the largest
        # bucket; one rank gathers nothing.
        largest = 256 * 128 * 4
        expected = largest if r["world"] == 2 else 0
        assert stats.peak_extra_bytes == expected
        assert r["num_buckets"] > 5


def test_sync_reshards_into_a_tensor_parallel_generator(engines_two_ranks):
    """The trainer's FSDP shards into a TP = 2 generator: each rank writes its own shard of
    every gathered tensor (fused QKV, row- and column-parallel layers, the vocabulary-parallel
    embedding), verified shard by shard; the whole tensors then equal the trainer's bit for
    bit, the prefix-cache control still shows stale KV, and the next samples are the new
    weights'. A rank holds about half the bytes it gathers."""
    for r in [rank["weight_sync"] for rank in engines_two_ranks["qwen3@tp2"]]:
        assert r["stale_params_before_sync"] == r["num_params"] == 20
        assert r["mismatched_after_sync"] == []
        assert r["version"] == 7  # the version sent took hold on the generator
        assert max(r["diff_before_step"], r["diff_long"], r["diff_short"]) <= 1e-5
        assert r["diff_stale_cache"] > 1e-2
        assert r["stats"].bytes == 1217536  # every fp32 parameter, gathered whole
        assert 0.5 * r["stats"].bytes <= r["generator_bytes"] < 0.51 * r["stats"].bytes


def test_a_lora_policy_reshards_into_a_tensor_parallel_generator(engines_two_ranks):
    """A LoRA policy's FSDP shards into the TP = 2 generator: every weight first, then after a
    step only the merged adapted linears (10 of the 20 tensors), each rank's shard verified
    against the merged whole tensor; the generator then holds the merged policy bit for bit
    and samples what the trainer's adapters compute."""
    for r in [rank["lora_sync"] for rank in engines_two_ranks["qwen3@tp2"]]:
        assert r["first_bytes"] == r["all_bytes"] == 1217536
        assert r["num_merged"] == 10
        assert r["second_bytes"] == r["merged_bytes"] < r["all_bytes"]
        assert r["mismatched"] == []
        assert r["diff"] <= 1e-5
        assert r["version"] == 2


def params(**shapes) -> dict[str, nn.Parameter]:
    g = torch.Generator().manual_seed(len(shapes))
    return {k: nn.Parameter(torch.randn(*s, generator=g)) for k, s in shapes.items()}


def test_a_bf16_generator_gathers_bf16_bytes(tmp_path):
    """fp32 master weights, bf16 generator: the all-gather moves bf16 (half the fp32 bytes),
    and each target is its source cast to bf16, bit for bit, through shared memory (ranks on
    one host) and through the process group (across hosts)."""
    run_dist("weight_sync_dtype_run.py", str(tmp_path), nproc=2)
    result = torch.load(tmp_path / "result.pt")
    params = 64 * 96 + 96 + 96 * 64 + 64
    assert result["shared_memory"]  # both ranks on this host: chosen by default
    for transport in ("shared", "process_group"):
        assert result[transport]["equal"], transport
        assert result[transport]["written"] == 2 * params
    # One bucket. Shared memory: one slot per rank of half the rows, 2 bytes each, for the
    # run. Process group: a send buffer of half the rows and a receive buffer of all.
    assert result["shared"]["peak"] == 2 * (params // 2) * 2
    assert result["process_group"]["peak"] == 2 * (params // 2 + params)
