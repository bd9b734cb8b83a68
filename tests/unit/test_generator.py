"""Generator pieces that need no engine: the plugin entry point, the packed MoE experts. The
engine itself: tests/integration/test_generator.py.

    .venv/bin/python -m pytest tests/unit/test_generator.py
"""

import pytest
import torch
import torch.nn as nn


def test_plugin_entry_point_registers_the_architecture():
    from vllm import ModelRegistry
    from vllm.plugins import load_general_plugins

    from torchtitan_rl.generator.plugin import ARCH

    load_general_plugins()  # what every vLLM process does at start: no import of ours needed
    assert ARCH in ModelRegistry.get_supported_archs()


@pytest.mark.parametrize(("name", "flavor"), [("qwen3", "tiny_moe"), ("gpt_oss", "tiny")])
def test_packed_experts_compute_the_trainers_moe_layer_and_follow_weight_updates(name, flavor):
    """vLLM's CPU fused-MoE kernel on the packed copy gives torchtitan's MoE layer (our
    Experts, or gpt-oss's OssExperts through the kernel's "swigluoai" with the biases) to fp32
    rounding; after the weights change in place (a weight sync), the stale copy does not, and
    `repack` brings it back."""
    import torch

    from torchtitan_rl.generator.packed import PackedExperts
    from torchtitan_rl.models import model_spec

    torch.manual_seed(0)
    moe = model_spec(name, flavor).model.layers[0].moe.build()
    with torch.no_grad():
        moe.init_states()
    x_BLD = torch.randn(2, 40, 128)
    with torch.no_grad():
        expected = moe(x_BLD)
        assert PackedExperts.fits(moe.routed_experts.inner_experts)
        original, packed = moe.routed_experts, PackedExperts(moe.routed_experts)
        moe.routed_experts = packed
        packed.repack()
        torch.testing.assert_close(moe(x_BLD), expected, rtol=1e-5, atol=1e-6)
        assert expected.abs().max() > 1e-3
        down = [
            p for n, p in packed.inner_experts.named_parameters() if "2_weight" in n or "w2" in n
        ]
        down[0].mul_(2.0)  # as weight sync writes in place
        torch.testing.assert_close(moe(x_BLD), expected, rtol=1e-5, atol=1e-6)  # stale
        packed.repack()
        moe.routed_experts = original  # torchtitan's dispatch on the updated weights
        updated = moe(x_BLD)
        moe.routed_experts = packed
        torch.testing.assert_close(moe(x_BLD), updated, rtol=1e-5, atol=1e-6)
        assert (updated - expected).abs().max() > 1e-3


def test_experts_the_fused_kernel_cannot_take_run_plain_and_say_why_once(capsys):
    """Issue 67: an MoE whose experts vLLM's fused-MoE kernel cannot take (a rank's expert
    width not a multiple of 32: tiny_moe's 64 over 4 ranks; gpt-oss's clamp other than 7) keeps
    the plain grouped GEMMs, and `_pack` says so in one line per cause, once."""
    import torch

    from torchtitan_rl.generator.packed import PackedExperts
    from torchtitan_rl.generator.vllm_model import _pack
    from torchtitan_rl.models import model_spec

    model = model_spec("qwen3", "tiny_moe").model.build()
    for layer in model.layers.values():
        experts = layer.moe.routed_experts.inner_experts
        experts.w2_EDF = torch.nn.Parameter(experts.w2_EDF[:, :, :16].clone())  # 64 / 4 ranks
    _pack(model)
    kept = [layer.moe.routed_experts for layer in model.layers.values()]
    assert not any(isinstance(routed, PackedExperts) for routed in kept)
    err = capsys.readouterr().err.splitlines()
    (line,) = [line for line in err if line.startswith("note:")]  # one for every layer
    assert "plain grouped GEMMs" in line and "expert width 16" in line
    oss = model_spec("gpt_oss", "tiny").model.layers[0].moe.build().routed_experts.inner_experts
    assert PackedExperts.fits(oss)
    oss.swiglu_limit = 10.0
    assert "clamp is 10" in PackedExperts.why_not(oss)


def test_the_eager_rank_count_gives_vllms_integers_across_chunks():
    """vLLM's sampler counts, per row, the logprobs >= the sampled token's (its rank) with a
    torch.compile'd function; the engine installs an eager one that works 256 rows at a time
    (engine_build.count_greater_equal). Same integers, rows on both sides of a chunk boundary,
    ties counted."""
    import torch
    from vllm.v1.sample import sampler
    from vllm.v1.sample.ops.logprobs import batched_count_greater_than

    from torchtitan_rl.generator import engine_build

    g = torch.Generator().manual_seed(0)
    x_NV = torch.randn(600, 68, generator=g).round(decimals=1)  # ties
    values_N1 = x_NV[torch.arange(600), torch.randint(0, 68, (600,), generator=g)][:, None]
    expected = (x_NV >= values_N1).sum(-1)  # what vLLM's docstring and body say
    assert torch.equal(engine_build.count_greater_equal(x_NV, values_N1), expected)
    assert torch.equal(
        batched_count_greater_than._torchdynamo_orig_callable(x_NV, values_N1), expected
    )
    assert engine_build.count_greater_equal(x_NV[:0], values_N1[:0]).shape == (0,)
    engine_build._use_eager_logprob_ranks()
    assert sampler.batched_count_greater_than is engine_build.count_greater_equal


def test_num_kv_blocks_is_capped_at_what_the_kv_space_holds(capsys):
    """512 blocks of the debugmodel (8 layers x 8 KV heads x 128 dims x 2 x 128 tokens x 4 B =
    8 MiB a block) would be 4 GiB: capped at the 1 GiB space's 128, and said; the tiny model's
    512 (128 KiB each) fit, and unset stays vLLM's."""
    from torchtitan_rl.config import GeneratorSection, ModelSection
    from torchtitan_rl.generator.engine_memory import kv_block_bytes, kv_blocks

    debug, tiny = ModelSection(flavor="debugmodel"), ModelSection(flavor="tiny")
    capped = GeneratorSection(num_kv_blocks=512, kv_cache_space_gib=1)
    assert kv_block_bytes(debug, capped) == 8 * 2**20
    assert kv_blocks(debug, capped) == 128
    assert "num_kv_blocks = 512 blocks of 8 MiB would take 4 GiB" in capsys.readouterr().err
    assert kv_blocks(ModelSection(flavor="debugmodel"), GeneratorSection(num_kv_blocks=100)) == 100
    assert kv_blocks(debug, GeneratorSection(num_kv_blocks=512, kv_cache_space_gib=4)) == 512
    assert kv_block_bytes(tiny, capped) == 128 * 2**10 and kv_blocks(tiny, capped) == 512
    assert kv_blocks(tiny, GeneratorSection()) is None
    # gpt-oss's sliding-window and full layers form two KV-cache groups that share each block's
    # memory: a block holds one layer's K and V, half of what its two layers would take.
    assert kv_block_bytes(ModelSection(name="gpt_oss", flavor="tiny"), capped) == 64 * 2**10
    bf16 = GeneratorSection(num_kv_blocks=512, dtype="bfloat16")
    assert kv_block_bytes(debug, bf16) == 4 * 2**20 and kv_blocks(debug, bf16) == 256


def test_routing_log_files_each_position_once_the_last_run_winning():
    """`RoutingLog`: each step's rows filed under the requests that ran them (vLLM's request
    ids, "{id}-{8 hex}", taken back to the ids they were added with), then `take`: a
    request's routed experts [T, M, K] from the steps that ran it, -1 where none did, past
    `length` dropped, and a position run twice (preempted, then recomputed) with its last
    run's ids, whether or not a take came between the steps. The capture buffers are
    preallocated per router."""
    from types import SimpleNamespace

    from torchtitan_rl.generator.routing import RoutingLog

    routers = [SimpleNamespace(gate=nn.Linear(4, 3), top_k=2) for _ in range(2)]
    log = RoutingLog(routers, rows=16)
    assert [r.capture_TK.shape for r in routers] == [(16, 2)] * 2
    assert all((r.capture_TK == -1).all() and r.capture_TK.dtype == torch.int32 for r in routers)
    ids = torch.arange(6 * 2 * 2, dtype=torch.int16).view(6, 2, 2)
    batch = SimpleNamespace(req_ids=[])
    log.runner = SimpleNamespace(input_batch=batch)

    def step(request_ids, positions, ids_TMK, starts):
        batch.req_ids = [f"{r}-0123abcd" for r in request_ids]
        log.file(torch.tensor(positions), ids_TMK, starts)

    step(["b", "a", "c"], [7, 0, 1, 2], torch.cat([ids[:1], ids[:3]]), [0, 1, 4, 4])
    step(["a", "b"], [3, 9], torch.cat([ids[3:4], ids[:1]]), [0, 1, 2])
    assert (log.take("unknown", 3) == -1).all()  # groups the steps so far
    step(["a"], [2, 3, 0], torch.cat([ids[4:6], ids[:1]]), [0, 2])  # recomputed: these win
    out = log.take("a", length=5)
    assert out.shape == (5, 2, 2) and out.dtype == torch.int16
    assert torch.equal(out[:2], ids[:2]) and torch.equal(out[2:4], ids[4:6])
    assert (out[4] == -1).all() and "a" not in log._requests
    b = log.take("b", length=10)
    assert torch.equal(b[7], ids[0]) and torch.equal(b[9], ids[0])
    assert (b[:7] == -1).all() and (b[8] == -1).all()
    assert torch.equal(log.take("a", 2), torch.full((2, 2, 2), -1, dtype=torch.int16))
    assert log._requests == {}


def test_packed_feed_forward_runs_w1_and_w3_in_one_gemm_and_follows_weight_updates():
    """`PackedFeedForward`: torchtitan's SwiGLU feed-forward with w1 and w3 stacked in one
    oneDNN GEMM (as vLLM's merged gate/up projection) computes the module's output to fp32
    rounding, keeps the weights under their FQNs, and after an in-place update (a weight
    sync) needs `repack` to follow it."""
    from torchtitan_rl.generator.packed import PackedFeedForward
    from torchtitan_rl.models import model_spec

    model = model_spec("qwen3", "tiny").model.build()
    with torch.no_grad():
        model.init_states()
    feed_forward = model.layers["0"].feed_forward
    assert PackedFeedForward.fits(feed_forward)
    x = torch.randn(2, 7, feed_forward.w1.weight.shape[1])
    expected = feed_forward(x)
    packed = PackedFeedForward(feed_forward)

    def repack():  # as the wrapper's `repack`: every packed module, w2's PackedLinear too
        for module in packed.modules():
            if hasattr(module, "repack"):
                module.repack()

    repack()
    torch.testing.assert_close(packed(x), expected, rtol=1e-5, atol=1e-5)
    names = {name for name, _ in packed.named_parameters()}
    assert names == {"w1.weight", "w2.weight", "w3.weight"}
    with torch.no_grad():
        feed_forward.w3.weight.mul_(2)
    updated = feed_forward(x)
    assert not torch.allclose(packed(x), updated, atol=1e-4)  # the stale stacked copy
    repack()
    torch.testing.assert_close(packed(x), updated, rtol=1e-5, atol=1e-5)


def test_a_gated_deltanets_six_projections_run_as_one_stacked_gemm():
    """`PackedStack` on Qwen3.5's Gated DeltaNet (as the generator's `_pack` sets it): the
    six input projections in one oneDNN GEMM give the layer's output to fp32 rounding, leave
    every parameter under its FQN, and follow an in-place weight update after `repack`."""
    from torchtitan_rl.generator.packed import PackedStack
    from torchtitan_rl.models import model_spec

    torch.manual_seed(0)
    model = model_spec("qwen3_5", "tiny").model.build()
    with torch.no_grad():
        model.init_states()
    layer = model.layers["0"].attn
    x = torch.randn(2, 7, layer.in_proj_q.weight.shape[1])
    names = {name for name, _ in layer.named_parameters()}
    expected = layer(x)
    assert PackedStack.fits(layer)
    layer.stacked = PackedStack([getattr(layer, name) for name in layer.PROJECTIONS])
    layer.stacked.repack()
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
    assert {name for name, _ in layer.named_parameters()} == names
    with torch.no_grad():
        layer.in_proj_b.weight.mul_(2)
    stale = layer(x)
    layer.stacked.repack()
    updated = layer(x)
    assert not torch.allclose(stale, updated, atol=1e-4)
    layer.stacked = None
    torch.testing.assert_close(updated, layer(x), rtol=1e-5, atol=1e-5)


def test_samples_of_one_prompt_share_the_routing_of_the_positions_one_of_them_ran():
    """A prompt's samples: a position only some of them ran (the others read its KV from the
    prefix cache) takes, where a sample did not run it, the first runner's routing; what a
    sample ran itself is kept; a position none ran stays -1; positions past the prompt are
    each sample's own."""
    import torch

    from torchtitan_rl.generator.engine_requests import _share_prompt_routing

    def ids(*rows):  # [T, M=1, K=2]
        return torch.tensor(rows, dtype=torch.int16)[:, None, :]

    a = ids([1, 2], [-1, -1], [-1, -1], [-1, -1], [5, 6])
    b = ids([-1, -1], [3, 4], [-1, -1], [7, 0], [-1, -1])
    c = ids([0, 1], [4, 3], [-1, -1], [-1, -1], [2, 2])
    _share_prompt_routing([a, b, c], prompt_length=4)
    assert torch.equal(a, ids([1, 2], [3, 4], [-1, -1], [7, 0], [5, 6]))
    assert torch.equal(b, ids([1, 2], [3, 4], [-1, -1], [7, 0], [-1, -1]))
    assert torch.equal(c, ids([0, 1], [4, 3], [-1, -1], [7, 0], [2, 2]))


def test_paged_attention_is_the_trainers_and_reads_the_batch_layout_once_per_forward(
    monkeypatch,
):
    """Batch-invariant paged attention (generator/attention.paged_attend) over a paged cache:
    a prefill of two prompts then a decode step of both, each on two layers (a gpt-oss-like
    sliding one among them, whose slots out of the window hold other data by the decode), give
    the trainer's causal attention over the whole sequence bit for bit; and each forward reads
    the batch's layout from the host once (2 reads), not once per layer."""
    from types import SimpleNamespace

    from torchtitan_rl.batch_invariant import ops
    from torchtitan_rl.generator import attention

    torch.manual_seed(0)
    N, K, H, block_size, blocks = 4, 2, 8, 4, 8
    lengths = (6, 3)  # prompt lengths; then one decoded token each
    table = torch.tensor([[0, 1, 2, 7], [3, 4, 5, 6]], dtype=torch.int32)
    q = [torch.randn(n + 1, N, H) for n in lengths]
    k = [torch.randn(n + 1, K, H) for n in lengths]
    v = [torch.randn(n + 1, K, H) for n in lengths]
    layers = {
        name: SimpleNamespace(kv_cache=torch.zeros(blocks, K, block_size, 2 * H))
        for name in ("full", "sliding")
    }

    def slot(sequence: int, position: int) -> int:
        return int(table[sequence, position // block_size]) * block_size + position % block_size

    def forward(rows: list[tuple[int, int]], seq_lens: list[int]) -> dict[str, torch.Tensor]:
        """Both layers over the flat batch of (sequence, position) rows."""
        starts = [0]
        for sequence in range(2):
            starts.append(starts[-1] + sum(1 for s, _ in rows if s == sequence))
        metadata = SimpleNamespace(
            slot_mapping=torch.tensor([slot(s, p) for s, p in rows]),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_table=table,
        )
        monkeypatch.setattr(attention, "_layer_context", lambda name: (metadata, layers[name]))
        flat = {
            t: torch.stack([x[s][p] for s, p in rows]) for t, x in (("q", q), ("k", k), ("v", v))
        }
        out = {}
        for name, window in (("full", None), ("sliding", 3)):
            out[name], _ = attention.paged_attend(
                flat["q"], flat["k"], flat["v"], name, H**-0.5, window, False, H
            )
        return out

    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(1) or tolist(t))
    prefill = [(s, p) for s, n in enumerate(lengths) for p in range(n)]
    prefilled = forward(prefill, list(lengths))
    assert len(reads) == 2  # query starts and sequence lengths, for both layers
    # The sliding layer's slots out of every query's window, which vLLM frees and reuses: what
    # they hold now must not reach the output.
    sliding = layers["sliding"].kv_cache.view(blocks, K, 2, block_size, H)
    for s, n in enumerate(lengths):
        for position in range(n - 2):  # the decode at position n sees n - 2 .. n
            sliding[table[s, position // block_size], :, :, position % block_size] = float("nan")
    decoded = forward([(s, n) for s, n in enumerate(lengths)], [n + 1 for n in lengths])
    assert len(reads) == 4

    for name, window in (("full", None), ("sliding", 3)):
        for s, n in enumerate(lengths):
            whole = ops.attention(
                q[s][None], k[s][None], v[s][None], torch.arange(n + 1)[None], H**-0.5, window
            )[0]
            rows = [i for i, (t, _) in enumerate(prefill) if t == s]
            assert torch.equal(prefilled[name][rows], whole[:n]), (name, s)
            assert torch.equal(decoded[name][s], whole[n]), (name, s)
