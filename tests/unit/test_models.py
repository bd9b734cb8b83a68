"""The model families and this project's mixture-of-experts modules (torchtitan_rl/models/):
the experts' two kernels agree (qwen3's and gpt-oss's), routing can be recorded and replayed
with gradients reaching the gate, batch-invariant experts give a token the same bits whoever
shares its expert, and weight sync's tensors include the router bias. gpt-oss's attention
(sinks, sliding window): the trainer's kernels against HF's formula, packed against alone.
MoE runs end to end: test_moe.py; gpt-oss against HF and vLLM: test_tiny_checkpoint.py.

    .venv/bin/python -m pytest tests/unit/test_models.py
"""

import pytest
import torch

from torchtitan_rl import batch_invariant
from torchtitan_rl.models import flavors, model_spec, moe, weights
from torchtitan_rl.models.moe import Experts, OssExperts, Router, routers
from torchtitan_rl.trainer.attention import DocumentCausalAttention, documents, sink_attention

MOE_MODELS = [("qwen3", "tiny_moe"), ("gpt_oss", "tiny")]


def tiny_moe(seed: int = 0, name: str = "qwen3", flavor: str = "tiny_moe"):
    torch.manual_seed(seed)
    model = model_spec(name, flavor).model.build()
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    return model


def experts_input(seed: int = 0, model=MOE_MODELS[0]):
    """8 experts of width 64 over dim 128; 40 routed rows, unevenly spread (one expert gets
    none)."""
    torch.manual_seed(seed)
    experts = tiny_moe(seed, *model).layers["0"].moe.routed_experts.inner_experts
    counts = torch.tensor([9, 0, 3, 12, 1, 5, 6, 4])
    return experts, torch.randn(int(counts.sum()), 128, requires_grad=True), counts


def test_every_registry_is_found_under_its_own_name():
    # gpt_oss's registry is `gptoss_configs`, not f"{name}_configs".
    assert "20b" in flavors("gpt_oss") and "debugmodel" in flavors("gpt_oss")
    assert {"tiny", "tiny_moe", "debugmodel_moe", "30B-A3B"} <= set(flavors("qwen3"))
    layer = tiny_moe().layers["0"].moe
    assert isinstance(layer.router, Router)
    assert isinstance(layer.routed_experts.inner_experts, Experts)
    oss = tiny_moe(0, "gpt_oss", "tiny").layers["0"].moe
    assert isinstance(oss.routed_experts.inner_experts, OssExperts)
    assert oss.router.gate.bias is not None  # gpt-oss's gate is biased: Router adds it


@pytest.mark.parametrize("model", MOE_MODELS)
def test_grouped_and_looped_experts_agree_values_and_gradients(model):
    experts, x_RD, counts = experts_input(model=model)
    grouped = experts(x_RD, counts)
    (grad_grouped,) = torch.autograd.grad(grouped.square().sum(), x_RD)
    batch_invariant.make_linears_invariant(experts)
    assert experts.batch_invariant
    looped = experts(x_RD, counts)
    (grad_looped,) = torch.autograd.grad(looped.square().sum(), x_RD)
    assert grouped.dtype == torch.float32  # the model's dtype: torchtitan's would be bf16
    torch.testing.assert_close(looped, grouped, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_looped, grad_grouped, rtol=1e-5, atol=1e-6)
    assert grouped.abs().max() > 1e-3


@pytest.mark.parametrize("model", MOE_MODELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariant_experts_give_a_row_the_same_bits_whoever_shares_its_expert(dtype, model):
    experts, x_RD, counts = experts_input(model=model)
    batch_invariant.make_linears_invariant(experts)
    experts = experts.to(dtype)
    x_RD = x_RD.detach().to(dtype)
    full = experts(x_RD, counts)
    row = x_RD[9 + 3 + 4]  # expert 3's fifth row
    for others in (0, 1, 2, 11, 30):  # expert 3 alone with the row, or among many
        alone = torch.cat([row[None], torch.randn(others, 128).to(dtype)])
        counts_alone = torch.tensor([0, 0, 0, 1 + others, 0, 0, 0, 0])
        assert torch.equal(experts(alone, counts_alone)[0], full[16]), others


def test_replayed_routing_is_used_and_the_gate_still_learns():
    model = tiny_moe()
    router = routers(model)[0]
    x_BLD = torch.randn(2, 5, 128)
    scores_own, ids_own, _ = router(x_BLD)
    expected = (ids_own + 1) % 8  # other experts for every token...
    expected[1, 3] = -1  # ...but one, which the generator did not route
    router.capture_TK = torch.full((16, router.top_k), -1, dtype=torch.int32)
    moe.expect([router], expected[..., None, :], replay=True)
    with moe.counting([router]):
        scores, ids, _ = router(x_BLD)
    assert torch.equal(ids[1, 3], ids_own[1, 3])
    # The capture holds the ids used, one row per token, written in place; rows past them untouched.
    assert torch.equal(router.capture_TK[:10], ids.reshape(10, -1).int())
    assert (router.capture_TK[10:] == -1).all()
    replayed = ids.clone()
    replayed[1, 3] = expected[1, 3]
    assert torch.equal(replayed, expected)
    assert not torch.equal(scores, scores_own)
    torch.testing.assert_close(scores.sum(-1), torch.ones(2, 5))  # renormalized top-k
    scores.square().sum().backward()
    assert router.gate.weight.grad is not None and router.gate.weight.grad.abs().sum() > 0
    assert moe.take_counts([router]) == (0, 9)  # replayed: what it used is what was expected


def test_routing_mismatch_counts_differing_top_k_sets_in_counted_forwards():
    router = routers(tiny_moe())[0]
    x_BLD = torch.randn(1, 6, 128)
    _, own, _ = router(x_BLD)
    expected = own.flip(-1).clone()  # the same sets in another order: no mismatch
    expected[0, 0] = (own[0, 0] + 3) % 8
    expected[0, 1, 1] = expected[0, 1, 0]  # a set with one expert twice: differs
    expected[0, 5] = -1
    moe.expect([router], expected[..., None, :], replay=False)
    router(x_BLD)  # not counted
    assert moe.take_counts([router]) == (0, 0)
    with moe.counting([router]):
        _, used, _ = router(x_BLD)
    assert torch.equal(used, own)  # without replay, its own routing
    differs_at_0 = set(own[0, 0].tolist()) != set(expected[0, 0].tolist())
    # Every router's two counts are read from the device together, once per call (a MoE
    # model's forwards count in each of its layers); dropping them reads nothing.
    from helpers.host_syncs import HostSyncs

    with HostSyncs() as syncs:
        taken = moe.take_counts([router, router])
    assert taken == (2 * (1 + int(differs_at_0)), 10)
    assert syncs.calls == [("tolist", "moe.take_counts")]
    assert moe.take_counts([router]) == (0, 0)
    with moe.counting([router]):
        router(x_BLD)
    with HostSyncs() as syncs:
        moe.drop_counts([router])
    assert syncs.calls == [] and moe.take_counts([router]) == (0, 0)
    moe.expect([router], None, replay=False)
    assert router(x_BLD)[1].equal(own)


def test_weight_sync_carries_the_router_bias_and_no_derived_buffer():
    model = tiny_moe()
    synced = weights(model)
    assert {"layers.0.moe.expert_bias_E", "layers.1.moe.expert_bias_E"} <= set(synced)
    assert not [name for name in synced if "rope" in name or "tokens_per_expert" in name]
    assert set(synced) - {n for n, _ in model.named_parameters()} == {
        "layers.0.moe.expert_bias_E",
        "layers.1.moe.expert_bias_E",
    }
    dense = model_spec("qwen3", "tiny").model.build()
    assert set(weights(dense)) == {n for n, _ in dense.named_parameters()}


def gpt_oss_attention_input(L: int, seed: int = 0):
    """q [1, L, 4, 32], k and v [1, L, 2, 32] (gpt-oss's tiny GQA), and 4 sinks, all leaves."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, L, n, 32, generator=g) for n in (4, 2, 2))
    sinks = torch.randn(4, generator=g)
    return [x.requires_grad_() for x in (q, k, v, sinks)]


def hf_eager_attention(q, k, v, sinks, window):
    """HF transformers' gpt-oss eager attention: the sink a softmax column of its own."""
    q_NLH, k_NLH, v_NLH = (x[0].transpose(0, 1) for x in (q, k, v))
    k_NLH, v_NLH = (x.repeat_interleave(2, dim=0) for x in (k_NLH, v_NLH))
    scores_NLL = q_NLH @ k_NLH.transpose(1, 2) * 32**-0.5
    i = torch.arange(q.shape[1])
    allowed = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < window)
    scores_NLL = scores_NLL.masked_fill(~allowed, float("-inf"))
    sink_NL1 = sinks[:, None, None].expand(-1, q.shape[1], 1)
    probs = torch.softmax(torch.cat([scores_NLL, sink_NL1], dim=-1), dim=-1)[..., :-1]
    return (probs @ v_NLH).transpose(0, 1)[None]


def test_sink_attention_is_hf_gpt_oss_attention_values_and_gradients():
    """torchtitan's sink rescale of `sink_attention`'s output and logsumexp equals the sink as
    a softmax column, gradients to q, k and the sinks included. The logsumexp's gradient
    matters: with it detached, q's and k's gradients here are off by 3.3 and 4.6."""
    from torchtitan.models.gpt_oss.model import apply_attention_sink_rescale

    q, k, v, sinks = gpt_oss_attention_input(40)
    rescale = lambda out, lse: apply_attention_sink_rescale(out, lse, sinks)  # noqa: E731
    ours = sink_attention(q, k, v, window=16, out_transform=rescale)
    reference = hf_eager_attention(q, k, v, sinks, window=16)
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6)
    grads_ours = torch.autograd.grad(ours.square().sum(), (q, k, sinks))
    grads_reference = torch.autograd.grad(reference.square().sum(), (q, k, sinks))
    for mine, theirs in zip(grads_ours, grads_reference, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5)
    # Both matter: without the window or the sinks the output is another.
    assert not torch.allclose(sink_attention(q, k, v, out_transform=rescale), ours, atol=1e-3)
    assert not torch.allclose(sink_attention(q, k, v, window=16), ours, atol=1e-3)


@pytest.mark.parametrize("invariant", [False, True])
def test_gpt_oss_layer_attention_packed_equals_each_sequence_alone(invariant):
    """A packed row of three sequences (one shorter than the 16-token window, two longer)
    through the inner attention the trainer builds for gpt-oss's windowed layer (plain, or
    batch-invariant) gives each sequence what it gets alone; the batch-invariant one gives the
    same bits, and agrees with the plain one."""
    from torchtitan.models.gpt_oss.model import apply_attention_sink_rescale

    q, k, v, sinks = gpt_oss_attention_input(20 + 7 + 33)
    rescale = lambda out, lse: apply_attention_sink_rescale(out, lse, sinks)  # noqa: E731
    if invariant:
        attention = batch_invariant.CausalAttention(
            batch_invariant.CausalAttention.Config(window=16)
        )
    else:
        attention = DocumentCausalAttention(DocumentCausalAttention.Config(window=16))
    packed = attention(
        q,
        k,
        v,
        attention_masks=documents([20, 7, 33], torch.device("cpu")),
        enable_gqa=True,
        out_transform=rescale,
    )
    for start, end in ((0, 20), (20, 27), (27, 60)):
        alone = attention(
            q[:, start:end],
            k[:, start:end],
            v[:, start:end],
            enable_gqa=True,
            out_transform=rescale,
        )
        if invariant:
            assert torch.equal(packed[:, start:end], alone)
        else:
            torch.testing.assert_close(packed[:, start:end], alone, rtol=1e-6, atol=1e-6)
        plain = sink_attention(
            q[:, start:end], k[:, start:end], v[:, start:end], window=16, out_transform=rescale
        )
        torch.testing.assert_close(alone, plain, rtol=1e-5, atol=1e-6)


def test_group_limited_routing_is_torchtitans_and_changes_the_choice():
    """DeepSeek-V3's grouped routing (tiny_grouped: 4 groups of 2 experts, each token's
    experts from its 2 best groups, the groups ranked by their two best scores plus the
    correction bias): our Router picks torchtitan's experts with torchtitan's weights, and the
    grouping is felt (the same gate without groups picks otherwise for some tokens)."""
    from torchtitan.models.common.moe import TokenChoiceTopKRouter

    ours = routers(tiny_moe(0, "deepseek_v3", "tiny_grouped"))[0]
    config = model_spec("deepseek_v3", "tiny_grouped").model.layers[1].moe.router
    theirs = TokenChoiceTopKRouter(TokenChoiceTopKRouter.Config(**_router_fields(config)))
    theirs.load_state_dict(ours.state_dict())
    torch.manual_seed(5)
    x_BLD, bias_E = torch.randn(1, 2000, 128), torch.randn(8) * 0.05
    scores, ids, _ = ours(x_BLD, bias_E)
    scores_theirs, ids_theirs, _ = theirs(x_BLD, bias_E)
    order, order_theirs = ids.argsort(-1), ids_theirs.argsort(-1)
    assert torch.equal(ids.gather(-1, order), ids_theirs.gather(-1, order_theirs))
    torch.testing.assert_close(scores.gather(-1, order), scores_theirs.gather(-1, order_theirs))
    groups_BLK = ids // 2
    assert ((groups_BLK[..., 0] != groups_BLK[..., 1]).float().mean()) > 0.3
    ungrouped = routers(tiny_moe(0, "deepseek_v3", "tiny"))[0]
    ungrouped.load_state_dict(ours.state_dict())
    changed = (ungrouped(x_BLD, bias_E)[1].sort(-1)[0] != ids.sort(-1)[0]).any(-1)
    assert 0.02 < changed.float().mean() < 1.0


def _router_fields(config) -> dict:
    names = ("num_experts", "gate", "num_expert_groups", "num_limited_groups", "top_k")
    names += ("score_func", "route_norm", "route_scale")
    return {name: getattr(config, name) for name in names}


@pytest.mark.parametrize("invariant", [False, True])
def test_latent_attention_packed_equals_each_sequence_alone(invariant):
    """DeepSeek-V3's multi-head latent attention hands the inner attention q/k heads of 64
    (32 + 32 RoPE dims) and v heads of 32: a packed row of three sequences through the inner
    attention the trainer builds (plain, or batch-invariant) gives each sequence what it gets
    alone, causal SDPA's output at the narrower value width; the batch-invariant one the same
    bits."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 60, 4, 64, generator=g) for _ in range(2))
    v = torch.randn(1, 60, 4, 32, generator=g)
    if invariant:
        attention = batch_invariant.CausalAttention(batch_invariant.CausalAttention.Config())
    else:
        attention = DocumentCausalAttention(DocumentCausalAttention.Config())
    docs = documents([20, 7, 33], torch.device("cpu"))
    packed = attention(q, k, v, attention_masks=docs, scale=0.3)
    assert packed.shape == (1, 60, 4, 32)
    for start, end in ((0, 20), (20, 27), (27, 60)):
        part = [x[:, start:end] for x in (q, k, v)]
        alone = attention(*part, scale=0.3)
        if invariant:
            assert torch.equal(packed[:, start:end], alone)
        reference = F.scaled_dot_product_attention(
            *(x.transpose(1, 2) for x in part), is_causal=True, scale=0.3
        ).transpose(1, 2)
        torch.testing.assert_close(packed[:, start:end], reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model", MOE_MODELS)
def test_batch_invariant_experts_compile_as_one_op_without_a_host_read(model):
    """Issue 67: vLLM traces its decoder once, guards dropped; the batch-invariant experts
    read each expert's row count on the host (`.tolist()`), which in the graph would be a
    host read at every step and a loop frozen at the traced routing. Compiled as the engine
    compiles (fullgraph, the routed rows dynamic), the graph holds one
    `torchtitan_rl::looped_experts` op and no host read, and other routings give the eager
    forward's bits."""
    experts, x_RD, counts = experts_input(model=model)
    batch_invariant.make_linears_invariant(experts)
    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(
        experts,
        backend=recording,
        fullgraph=True,
        options={"guard_filter_fn": torch.compiler.skip_all_guards_unsafe},
    )
    x_RD = x_RD.detach()
    torch._dynamo.mark_dynamic(x_RD, 0)
    with torch.no_grad():
        assert torch.equal(compiled(x_RD, counts), experts(x_RD, counts))
        (graph,) = graphs
        code = graph.code
        assert "looped_experts" in code
        assert not any(read in code for read in ("tolist", "item", "_local_scalar_dense"))
        for other in (
            [0, 7, 0, 2, 30, 1, 0, 0],
            [1, 1, 1, 1, 1, 1, 1, 1],
            [0, 0, 0, 0, 0, 0, 0, 3],
        ):
            counts_E = torch.tensor(other)
            rows_RD = torch.randn(int(counts_E.sum()), 128)
            assert torch.equal(compiled(rows_RD, counts_E), experts(rows_RD, counts_E)), other
    assert len(graphs) == 1
    torch._dynamo.reset()


def _rank_share(routed, rank: int, split: str):
    """A copy of an MoE layer's routed experts as one of 2 tensor-parallel generator ranks
    holds them on plain local shards (generator/tensor_parallel.py): every expert's hidden
    units halved ("hidden", the plan's default), or half the experts whole ("experts")."""
    import copy

    from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

    from torchtitan_rl.generator.tensor_parallel import RankExperts

    share = copy.deepcopy(routed)
    inner, old = share.inner_experts, share.token_dispatcher
    # Each weight's sharded dim under the plan: w1/w3 [E, F, D] and mlp1 [E, 2F, D] rows,
    # w2 / mlp2 [E, D, F] columns, mlp1's bias [E, 2F]; mlp2's bias [E, D] whole.
    hidden = {"w1_EFD": 1, "w3_EFD": 1, "w2_EDF": 2, "mlp1_weight_EGD": 1}
    hidden |= {"mlp1_bias_EG": 1, "mlp2_weight_EDF": 2}
    for name, param in list(inner.named_parameters()):
        dim = 0 if split == "experts" else hidden.get(name)
        if dim is not None:
            piece = param.detach().chunk(2, dim=dim)[rank].clone()
            setattr(inner, name, torch.nn.Parameter(piece, requires_grad=False))
    if split == "experts":
        count = old.num_experts // 2
        share.token_dispatcher = RankExperts(old.num_experts, old.top_k, rank * count, count)
    else:
        config = LocalTokenDispatcher.Config(num_experts=old.num_experts, top_k=old.top_k)
        share.token_dispatcher = LocalTokenDispatcher(config)
        if isinstance(inner, OssExperts):
            inner.tp_degree = 2  # each rank adds half of the output bias
    return share


@pytest.mark.parametrize("invariant", [False, True], ids=["grouped", "invariant"])
@pytest.mark.parametrize("split", ["hidden", "experts"])
@pytest.mark.parametrize("model", MOE_MODELS)
def test_experts_split_over_two_ranks_sum_to_the_whole_layer_compiled(model, split, invariant):
    """Issue 67: a tensor-parallel generator's MoE layer on plain local shards, each of 2 ranks
    holding half of every expert's hidden units or half the experts whole (`RankExperts`), sums
    to the one-rank layer (the all-reduce), compiled as vLLM compiles (fullgraph, traced once
    at one token count, guards dropped), at token counts it was not traced at, and the graph
    reads nothing on the host (`torchtitan_rl::grouped_mm` for fp32, `looped_experts` under
    batch-invariant mode: opaque)."""
    from helpers.compiled_graphs import host_reads, recording

    layer = tiny_moe(0, *model).layers["0"].moe
    if invariant:
        batch_invariant.make_linears_invariant(layer)
    shares = [_rank_share(layer.routed_experts, rank, split) for rank in (0, 1)]

    def routed(experts, x_1TD):
        scores, ids, all_scores = layer.router(x_1TD, layer.expert_bias_E)
        counts = torch.zeros_like(all_scores, dtype=torch.bool).scatter_(-1, ids, True)
        return experts(x_1TD, scores, ids, counts.sum((0, 1)))  # as torchtitan's MoE counts

    options = {"guard_filter_fn": torch.compiler.skip_all_guards_unsafe}
    inputs = [torch.randn(1, tokens, 128) for tokens in (24, 7, 61)]
    torch._dynamo.mark_dynamic(inputs[0], 1)
    summed = [0, 0, 0]
    with torch.no_grad():
        for share in shares:  # each rank's process traces its own graph, once
            torch._dynamo.reset()
            compiled = torch.compile(routed, backend="eager", fullgraph=True, options=options)
            with recording() as graphs:
                for i, x_1TD in enumerate(inputs):
                    summed[i] = summed[i] + compiled(share, x_1TD)
            assert len(graphs) == 1
            assert host_reads(graphs[0]) == []
        for x_1TD, total in zip(inputs, summed, strict=True):
            whole = routed(layer.routed_experts, x_1TD)
            torch.testing.assert_close(total, whole, rtol=1e-5, atol=1e-5)
            assert whole.abs().max() > 1e-3  # the layer computed something
    torch._dynamo.reset()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("model", MOE_MODELS)
def test_whole_experts_over_two_ranks_add_a_tokens_experts_as_one_device_under_the_mode(
    model, dtype
):
    """Issue 77: under batch-invariant mode an expert-parallel generator's ranks (`RankExperts`,
    half the experts whole each) put their experts' rows in place, the rows are summed over the
    ranks (each to zeros: exact), and every rank adds a token's experts in the one-device
    order: the layer's output equals the one-device layer's bit for bit, with 4 experts a
    token (gpt-oss routes 4, Qwen3-MoE 8). The plain order (each rank adds its own experts'
    share of a token, then the shares are summed) does not."""
    layer = tiny_moe(0, *model).layers["0"].moe.to(dtype)
    layer.router.top_k = layer.routed_experts.token_dispatcher.top_k = 4
    batch_invariant.make_linears_invariant(layer)
    shares = [_rank_share(layer.routed_experts, rank, "experts") for rank in (0, 1)]
    x_1TD = torch.randn(1, 61, 128).to(dtype)
    with torch.no_grad():
        scores, ids, all_scores = layer.router(x_1TD, layer.expert_bias_E)
        counts = torch.zeros_like(all_scores, dtype=torch.bool).scatter_(-1, ids, True)
        args = (x_1TD, scores, ids, counts.sum((0, 1)))
        whole = layer.routed_experts(*args)
        plain = sum(share(*args) for share in shares)  # sum_rows unset: the plain order
        rows = []  # each rank's rows in place; then their sum, as vLLM's all-reduce gives it
        for share in shares:
            share.token_dispatcher.sum_rows = lambda rows_ND: rows.append(rows_ND) or rows_ND
            share(*args)
        total_ND = rows[0] + rows[1]
        assert torch.equal(total_ND, torch.where(rows[0] != 0, rows[0], rows[1]))  # no add
        for share in shares:
            share.token_dispatcher.sum_rows = lambda rows_ND: total_ND
            assert torch.equal(share(*args), whole)
    assert whole.abs().max() > 1e-3
    assert not torch.equal(plain, whole)
