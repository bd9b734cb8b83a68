"""Qwen3.5's Gated DeltaNet in plain torch (models/gated_delta.py, models/qwen3_5.py): the
chunked and the recurrent forms against each other and against transformers' own PyTorch
fallbacks, states carried across a cut, gradients, and the layer over packed and padded rows.

    .venv/bin/python -m pytest tests/unit/test_gated_delta.py
"""

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
