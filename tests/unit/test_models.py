"""The model families and this project's mixture-of-experts modules (torchtitan_rl/models/):
the experts' two kernels agree, routing can be recorded and replayed with gradients reaching
the gate, batch-invariant experts give a token the same bits whoever shares its expert, and
weight sync's tensors include the router bias. MoE runs end to end: test_moe.py.

    .venv/bin/python -m pytest tests/unit/test_models.py
"""

import pytest
import torch

from torchtitan_rl import batch_invariant
from torchtitan_rl.models import flavors, model_spec, moe, weights
from torchtitan_rl.models.moe import Experts, Router, routers


def tiny_moe(seed: int = 0):
    torch.manual_seed(seed)
    model = model_spec("qwen3", "tiny_moe").model.build()
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    return model


def experts_input(seed: int = 0):
    """8 experts of width 64 over dim 128; 40 routed rows, unevenly spread (one expert gets
    none)."""
    torch.manual_seed(seed)
    experts = tiny_moe(seed).layers["0"].moe.routed_experts.inner_experts
    counts = torch.tensor([9, 0, 3, 12, 1, 5, 6, 4])
    return experts, torch.randn(int(counts.sum()), 128, requires_grad=True), counts


def test_every_registry_is_found_under_its_own_name():
    # gpt_oss's registry is `gptoss_configs`, not f"{name}_configs".
    assert "20b" in flavors("gpt_oss") and "debugmodel" in flavors("gpt_oss")
    assert {"tiny", "tiny_moe", "debugmodel_moe", "30B-A3B"} <= set(flavors("qwen3"))
    layer = tiny_moe().layers["0"].moe
    assert isinstance(layer.router, Router)
    assert isinstance(layer.routed_experts.inner_experts, Experts)


def test_grouped_and_looped_experts_agree_values_and_gradients():
    experts, x_RD, counts = experts_input()
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariant_experts_give_a_row_the_same_bits_whoever_shares_its_expert(dtype):
    experts, x_RD, counts = experts_input()
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
    seen = []
    router.record = seen.append
    moe.expect([router], expected[..., None, :], replay=True)
    with moe.counting([router]):
        scores, ids, _ = router(x_BLD)
    assert torch.equal(ids[1, 3], ids_own[1, 3]) and torch.equal(seen[0], ids)
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
    assert moe.take_counts([router]) == (1 + int(differs_at_0), 5)
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
