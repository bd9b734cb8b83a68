"""Batch-invariant kernels: a row's result never depends on the rows beside it, and the start
check finds kernels that do. The mode in real runs: tests/integration/test_batch_invariant.py.

    .venv/bin/python -m pytest tests/unit/test_batch_invariant.py
"""

import pytest
import torch
import torch.nn.functional as F

from torchtitan_rl.batch_invariant import ops

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_linear_row_does_not_depend_on_the_batch(dtype):
    torch.manual_seed(0)
    weight, x = torch.randn(256, 128).to(dtype), torch.randn(100, 128).to(dtype)
    full = ops.linear(x, weight)
    for rows in (1, 2, 3, 7, 16, 17, 100):
        for i in (0, rows // 2, rows - 1):
            batch = torch.randn(rows, 128).to(dtype)
            batch[i] = x[5]
            assert torch.equal(ops.linear(batch, weight)[i], full[5]), (rows, i)
    assert torch.allclose(full.float(), F.linear(x, weight).float(), rtol=1e-2, atol=1e-5)


def test_linear_gradients_are_the_plain_ones():
    torch.manual_seed(0)
    x = torch.randn(30, 128, requires_grad=True)
    weight = torch.randn(64, 128, requires_grad=True)
    bias = torch.randn(64, requires_grad=True)
    ops.linear(x, weight, bias).square().sum().backward()
    ours = [x.grad.clone(), weight.grad.clone(), bias.grad.clone()]
    for t in (x, weight, bias):
        t.grad = None
    F.linear(x, weight, bias).square().sum().backward()
    for mine, plain in zip(ours, (x.grad, weight.grad, bias.grad), strict=True):
        assert torch.allclose(mine, plain, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_attention_row_is_the_same_in_full_forward_chunked_prefill_and_decode(dtype):
    """The trainer's full causal forward, a generator decode of one row and a chunked prefill
    give the same bits for a position (keys past 64 and 128 included)."""
    torch.manual_seed(0)
    B, T, N, K, H = 2, 150, 4, 2, 32
    q, k, v = (torch.randn(B, T, n, H).to(dtype) for n in (N, K, K))
    full = ops.attention(q, k, v, torch.arange(T).expand(B, T))
    zero = torch.zeros(1, 1, dtype=torch.long)
    for b in range(B):
        q1, k1, v1 = q[b : b + 1], k[b : b + 1], v[b : b + 1]
        for t in (0, 1, 15, 16, 63, 64, 65, 127, 128, 149):
            decode = ops.attention(q1[:, t : t + 1], k1[:, : t + 1], v1[:, : t + 1], t + zero)
            assert torch.equal(decode[0, 0], full[b, t]), (b, t)
        for first, last in ((0, 40), (40, 77), (77, 150)):
            positions = torch.arange(first, last)[None]
            chunk = ops.attention(q1[:, first:last], k1[:, :last], v1[:, :last], positions)
            assert torch.equal(chunk[0], full[b, first:last]), (b, first)
    sdpa = F.scaled_dot_product_attention(
        *(t.float().transpose(1, 2) for t in (q, k, v)), is_causal=True, enable_gqa=True
    ).transpose(1, 2)
    assert torch.allclose(full.float(), sdpa, atol=1e-5 if dtype == torch.float32 else 2e-2)


def test_the_start_check_finds_kernels_that_depend_on_the_row_count(monkeypatch):
    """The check each side runs at start (this machine's threads and ISA): the real kernels
    pass at the tiny and 0.6B widths; without row padding (plain GEMMs, M-dependent here) it
    names the failing kernel."""
    assert ops.invariance_failures(128, 4, 32, torch.float32) == []
    assert ops.invariance_failures(1024, 16, 128, torch.bfloat16) == []
    monkeypatch.setattr(ops, "ROW_TILE", 1)
    assert "linear rows 0..0 alone vs 40 rows" in ops.invariance_failures(
        1024, 16, 128, torch.float32
    )


@pytest.mark.parametrize("name", sorted(ops.POINTWISE))
def test_pointwise_traced_once_as_vllm_traces_runs_at_every_size(name):
    """Issue 67: vLLM compiles its decoder once (Dynamo, every guard dropped, the token
    dimension dynamic), so a Python loop over `pointwise`'s GRAIN-sized pieces would be frozen
    at the traced size (traced at 1,000 tokens it raised at 40,000). As one opaque op it runs
    at sizes across every boundary it has (a vector of LANES, a piece of GRAIN, several
    pieces) with the eager op's bits."""
    fn = ops.POINTWISE[name]
    compiled = torch.compile(
        lambda x: ops.pointwise(fn, x),
        backend="eager",
        fullgraph=True,
        options={"guard_filter_fn": torch.compiler.skip_all_guards_unsafe},
    )
    g = torch.Generator().manual_seed(0)
    traced = torch.randn(1000, 4, generator=g)
    torch._dynamo.mark_dynamic(traced, 0)
    torch.testing.assert_close(compiled(traced), fn(traced), rtol=1e-6, atol=1e-6)
    for tokens in (1, 15, 16, 8192, 8193, 16384, 20000, 40000):
        x = torch.randn(tokens, 4, generator=g) * 4
        assert torch.equal(compiled(x), ops.pointwise(fn, x)), tokens
        torch.testing.assert_close(compiled(x), fn(x), rtol=1e-6, atol=1e-6)
    torch._dynamo.reset()


def test_linear_traced_once_as_vllm_traces_keeps_its_rows_at_every_size():
    """Issue 67: `ops.linear` pads its rows to ROW_TILE with shape arithmetic, no Python loop:
    traced once as vLLM traces (one size, guards dropped, the token dimension dynamic), it runs
    at sizes across the tile's boundaries with the eager op's bits, and a row's bits do not
    depend on the rows around it; its graph reads nothing on the host."""
    from helpers.compiled_graphs import host_reads, recording

    g = torch.Generator().manual_seed(2)
    weight, bias = torch.randn(48, 64, generator=g), torch.randn(48, generator=g)
    options = {"guard_filter_fn": torch.compiler.skip_all_guards_unsafe}
    torch._dynamo.reset()
    compiled = torch.compile(ops.linear, backend="eager", fullgraph=True, options=options)
    traced = torch.randn(1, 20, 64, generator=g)
    torch._dynamo.mark_dynamic(traced, 1)
    with recording() as graphs:
        compiled(traced, weight, bias)
        for tokens in (1, 15, 16, 17, 31, 33, 100):
            x = torch.randn(1, tokens, 64, generator=g)
            out = compiled(x, weight, bias)
            assert torch.equal(out, ops.linear(x, weight, bias)), tokens
            assert torch.equal(out[:, :1], ops.linear(x[:, :1], weight, bias)), tokens
    assert len(graphs) == 1 and host_reads(graphs[0]) == []
    torch._dynamo.reset()


def test_pointwise_gradients_are_its_pieces_own():
    """The op's backward differentiates the same pieces: each element's derivative as ATen's
    vector code gives it, bit for bit what autograd through the pieces gave."""
    g = torch.Generator().manual_seed(1)
    for name, fn in ops.POINTWISE.items():
        x = (torch.randn(40_001, generator=g) * 3).requires_grad_()
        upstream = torch.randn(40_001, generator=g)
        (ops.pointwise(fn, x) * upstream).sum().backward()
        op_grad, x.grad = x.grad, None
        (ops._in_pieces(x, name) * upstream).sum().backward()
        assert torch.equal(op_grad, x.grad), name
        torch.testing.assert_close(op_grad, torch.func.vjp(fn, x.detach())[1](upstream)[0])
    with pytest.raises(ValueError, match="ops.pointwise runs sigmoid, softplus, silu, not tanh"):
        ops.pointwise(torch.tanh, torch.ones(3))


# Row-parallel shapes of the models the suite runs: (rows, reduction, outputs).
ROW_PARALLEL_SHAPES = [(1, 64, 64), (37, 256, 128), (300, 1536, 576), (5, 576, 1536)]


def rank_partials(x, w, ranks: int, width: int) -> list[torch.Tensor]:
    """Each of `ranks` TP ranks' `partial_products`: its contiguous block of the input columns."""
    block = x.shape[-1] // ranks
    cols = [slice(r * block, (r + 1) * block) for r in range(ranks)]
    return [ops.partial_products(x[:, c], w[:, c], width) for c in cols]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_parallel_layers_canonical_reduction_is_the_same_on_one_rank_and_split(dtype):
    """A TP generator's rank holds a contiguous block of a row-parallel layer's input columns:
    its `partial_products` over its slices, combined with the other ranks' (two ranks: an
    all-reduce, a + b in either order; four: the gathered partials summed as the tree), equal
    the one-device product over all the slices bit for bit, at every row count. Without the
    canonical order (each rank's plain product, summed) they do not, nor with the slices
    folded left to right (planted: the rank split regroups the sums)."""
    g = torch.Generator().manual_seed(0)
    plain_differs = fold_differs = False
    for rows, width_in, width_out in ROW_PARALLEL_SHAPES:
        x = torch.randn(rows, width_in, generator=g).to(dtype)
        w = torch.randn(width_out, width_in, generator=g).to(dtype)
        for slices in (2, 4):
            width = width_in // slices
            whole = ops.partial_products(x, w, width)
            a, b = rank_partials(x, w, 2, width)
            assert torch.equal(a + b, whole) and torch.equal(b + a, whole), (rows, slices)
            if slices == 4:
                four = rank_partials(x, w, 4, width)
                gathered = ops.combine_partials(
                    four[0],
                    4,
                    all_reduce=None,
                    all_gather=lambda y, dim, four=four: torch.stack(four),
                )
                assert torch.equal(gathered, whole), rows
            assert torch.equal(ops.partial_products(x[:1], w, width), whole[:1])  # row-invariant
        half = width_in // 2
        split = ops.linear(x[:, :half], w[:, :half]).float() + ops.linear(x[:, half:], w[:, half:])
        plain_differs |= not torch.equal(split, ops.linear(x, w).float())
        q = [p.float() for p in rank_partials(x, w, 4, width_in // 4)]
        fold_differs |= not torch.equal(
            ((q[0] + q[1]) + q[2]) + q[3], (q[0] + q[1]) + (q[2] + q[3])
        )
    assert plain_differs and fold_differs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_column_parallel_layers_and_attention_heads_need_no_canonical_order(dtype):
    """What a TP generator's rank computes unchanged under the mode: a column-parallel linear
    (q/k/v, gate/up, the vocabulary-parallel head: its block of output rows) equals that block
    of the one-device `ops.linear`, and `ops.attention` over a rank's block of query heads with
    their KV heads equals those heads of the whole, bit for bit (a dot product's order does not
    depend on how many others run beside it, once `ops.linear` pads the outputs to COL_TILE:
    unpadded, a 4-wide layer's halves rounded otherwise, found by Qwen3.5's gate projections
    at generator TP 2). The vocabulary-parallel embedding's sum over ranks adds zeros:
    exact."""
    g = torch.Generator().manual_seed(0)
    # The narrow ones: Qwen3.5's gate projections (one value per head), 4 and 32 heads wide.
    shapes = [(1, 128, 256), (37, 576, 1536), (300, 576, 49152 // 8), (37, 256, 4), (5, 576, 32)]
    for rows, width_in, width_out in shapes:
        x = torch.randn(rows, width_in, generator=g).to(dtype)
        w = torch.randn(width_out, width_in, generator=g).to(dtype)
        whole = ops.linear(x, w)
        for r in range(2):
            block = slice(r * width_out // 2, (r + 1) * width_out // 2)
            mine = ops.linear(x, w[block].contiguous())
            assert torch.equal(mine, whole[:, block]), rows
            # Contiguous where the padding was cut off: vLLM's CPU gather of the
            # vocabulary-parallel head's logits refuses a strided tensor.
            assert mine.is_contiguous(), (rows, width_out)
    B, L, N, K, H = 2, 40, 8, 2, 64
    q = torch.randn(B, L, N, H, generator=g).to(dtype)
    k, v = (torch.randn(B, L, K, H, generator=g).to(dtype) for _ in range(2))
    positions = torch.arange(L).expand(B, L)
    whole = ops.attention(q, k, v, positions)
    for r in range(2):
        heads, kv = slice(r * N // 2, (r + 1) * N // 2), slice(r * K // 2, (r + 1) * K // 2)
        mine = ops.attention(q[:, :, heads], k[:, :, kv], v[:, :, kv], positions)
        assert torch.equal(mine, whole[:, :, heads]), r


def test_the_slices_follow_the_runs_layouts(monkeypatch):
    """The row-parallel layers' slices are the run's largest TP degree; a routed expert's down
    projection is sliced only where a TP generator splits every expert's hidden units (not
    with generator.parallelism.expert_parallel: whole experts on every side, one GEMM)."""
    from torchtitan_rl import batch_invariant, platform
    from torchtitan_rl.config import parse_args

    monkeypatch.setattr(platform, "enable_batch_invariance", lambda: None)
    for attr in ("_enabled", "_slices", "_expert_slices"):
        monkeypatch.setattr(batch_invariant, attr, getattr(batch_invariant, attr))
    debug = ["--job.config_file", "run_configs/debug_cpu.toml"]
    moe = ["--model.flavor", "tiny_moe", "--model.hf_checkpoint", "assets/tiny_moe_qwen3"]
    generator_tp = ["--generator.parallelism.tensor_parallel_degree", "2"]
    cases = [
        ([], (1, 1)),
        (["--parallelism.tp", "2"], (2, 2)),
        ([*moe, "--parallelism.ep", "2", *generator_tp], (2, 2)),
        ([*moe, *generator_tp, "--generator.parallelism.expert_parallel", "true"], (2, 1)),
    ]
    for flags, expected in cases:
        config = parse_args([*debug, "--batch_invariant", "true", *flags], 2)
        batch_invariant.enable_for(config)
        assert (batch_invariant._slices, batch_invariant._expert_slices) == expected, flags


def test_only_row_parallel_linears_reduce_canonically_with_the_plain_gradients(monkeypatch):
    """With reduction slices > 1, `make_linears_invariant` gives the canonical reduction to
    exactly the linears the TP plan splits by input columns (attention output, MLP down
    projection, read from torchtitan's sharding config), each slice `in_features / slices`
    wide; the rest keep `ops.linear`. Their gradients are the plain linear's."""
    from torchtitan_rl import batch_invariant
    from torchtitan_rl.config import ParallelismSection
    from torchtitan_rl.models import model_spec
    from torchtitan_rl.trainer.parallel import fill_sharding_plan, layout

    monkeypatch.setattr(batch_invariant, "_slices", 2)
    for name in ("qwen3", "llama3"):
        spec = model_spec(name, "tiny")
        fill_sharding_plan(spec, layout(ParallelismSection(), 1)[1])
        model = spec.model.build()
        batch_invariant.make_linears_invariant(model)
        canonical = {
            n.split(".", 2)[-1]
            for n, m in model.named_modules()
            if getattr(m, "reduction_width", None) is not None
        }
        assert canonical == {"attention.wo", "feed_forward.w2"}, (name, canonical)
        wo = model.layers["0"].attention.wo
        assert wo.reduction_width == wo.in_features // 2 and wo.tp_combine is None
        x = torch.randn(3, 5, wo.in_features, requires_grad=True)
        y = wo(x)
        expected = ops.partial_products(x, wo.weight, wo.in_features // 2).to(x.dtype)
        assert torch.equal(y, expected)
        y.square().sum().backward()
        x_ref = x.detach().clone().requires_grad_()
        F.linear(x_ref, wo.weight).square().sum().backward()
        torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)


def _experts_of(name: str, flavor: str, dtype: torch.dtype) -> torch.nn.Module:
    """The first MoE layer's routed experts of `name`/`flavor`, random weights in `dtype`,
    batch-invariant with 2 reduction slices (the caller sets them)."""
    from torchtitan_rl import batch_invariant
    from torchtitan_rl.models import model_spec

    spec = model_spec(name, flavor)
    moe = next(layer.moe for layer in spec.model.layers if getattr(layer, "moe", None))
    experts = moe.routed_experts.inner_experts.build()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    batch_invariant.make_linears_invariant(experts.to(dtype))
    return experts


def _hidden_half(experts: torch.nn.Module, rank: int) -> torch.nn.Module:
    """A TP generator rank's copy of `experts`: its half of every expert's hidden units (the
    spec's TP plan: w1, w3 by rows; w2 by columns; gpt-oss's interleaved mlp1 likewise, its
    output bias whole)."""
    import copy

    mine = copy.deepcopy(experts)
    for name, p in mine.named_parameters():
        dim = {"w1_EFD": 1, "w3_EFD": 1, "w2_EDF": 2, "mlp1_weight_EGD": 1, "mlp1_bias_EG": 1}
        dim.update(mlp2_weight_EDF=2)
        if name in dim:
            half = p.shape[dim[name]] // 2
            p.data = p.data.narrow(dim[name], rank * half, half).contiguous()
    return mine


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("family", [("qwen3", "tiny_moe"), ("gpt_oss", "tiny")])
def test_experts_split_by_hidden_units_reduce_as_on_one_device(family, dtype, monkeypatch):
    """Under the mode with 2 reduction slices, an MoE layer's routed experts on one device
    (the trainer's, experts whole under EP) and split by hidden units over 2 TP generator
    ranks, whose partial sums `tp_combine` adds in fp32 before gpt-oss's output bias and the
    rounding, give every routed row the same bits; so do a row alone and among all.
    Planted, the plain layer (slices 1: one GEMM over the hidden units on one device, each
    rank's rounded output summed over the ranks) does not."""
    from torchtitan_rl import batch_invariant

    monkeypatch.setattr(batch_invariant, "_expert_slices", 2)
    experts = _experts_of(*family, dtype)
    assert experts.reduction_width == experts.hidden_dim // 2
    g = torch.Generator().manual_seed(2)
    counts_E = torch.tensor([5, 0, 17, 1] + [3] * (experts.num_experts - 4))
    x_RD = torch.randn(
        int(counts_E.sum()) + 3,
        experts.w1_EFD.shape[-1]
        if hasattr(experts, "w1_EFD")
        else experts.mlp1_weight_EGD.shape[-1],
        generator=g,
    ).to(dtype)
    whole_RD = experts(x_RD, counts_E)
    ranks = [_hidden_half(experts, r) for r in range(2)]
    partials = []
    ranks[1].tp_combine = lambda y: partials.append(y) or y
    ranks[1](x_RD, counts_E)
    ranks[0].tp_combine = lambda y: y + partials[0]
    rows = int(counts_E.sum())
    assert torch.equal(ranks[0](x_RD, counts_E)[:rows], whole_RD[:rows]), family
    one_E = torch.zeros_like(counts_E)
    one_E[2] = 1
    assert torch.equal(experts(x_RD[5:6], one_E), whole_RD[5:6])  # row-invariant

    # Planted: the plain layer on each side (slices 1): one GEMM over all hidden units on one
    # device; each rank's over its half, rounded, summed over the ranks.
    monkeypatch.setattr(batch_invariant, "_expert_slices", 1)
    one_device = _experts_of(*family, dtype)
    plain = [_hidden_half(one_device, r) for r in range(2)]
    for rank in plain:
        rank.tp_degree = 2  # gpt-oss's output bias, half on each rank
    summed = (plain[0](x_RD, counts_E).float() + plain[1](x_RD, counts_E)).to(dtype)
    assert not torch.equal(summed[:rows], one_device(x_RD, counts_E)[:rows]), family
