"""PolicyTrainer in a one-process world: HF loading, errors, non-finite steps, LR schedule.

.venv/bin/python -m pytest tests/unit/test_model.py
"""

import json
import shutil

import pytest
import torch
from helpers.batches import recorded_grads
from helpers.host_syncs import HOST_PLANNERS
from helpers.launch import REPO
from safetensors.torch import load_file, save_file

from torchtitan_rl import platform
from torchtitan_rl.config import (
    ConfigError,
    ModelSection,
    ParallelismSection,
    TrainingSection,
)
from torchtitan_rl.hf_export import export_hf
from torchtitan_rl.trainer.policy_trainer import NonFiniteError, PolicyTrainer
from torchtitan_rl.types import RolloutBatch

TINY = REPO / "assets" / "tiny_qwen3"


@pytest.fixture(scope="module", autouse=True)
def _world_of_one():
    platform.patch_torchtitan()
    platform.init_distributed()


def trainer(**model_fields) -> PolicyTrainer:
    training = model_fields.pop("training", TrainingSection())
    return PolicyTrainer(
        model=ModelSection(**{"hf_checkpoint": str(TINY), **model_fields}),
        training=training,
        parallelism=ParallelismSection(),
    )


def full_state(t: PolicyTrainer) -> dict[str, torch.Tensor]:
    # An MoE's routers' bias is a buffer FSDP leaves whole.
    return {k: getattr(v, "full_tensor", v.detach)().clone() for k, v in t.state_dict().items()}


def batch() -> RolloutBatch:
    tokens_BT = torch.randint(3, 64, (4, 10), generator=torch.Generator().manual_seed(1))
    mask_BT = torch.zeros(4, 10)
    mask_BT[:, 5:] = 1.0
    return RolloutBatch(
        tokens_BT=tokens_BT,
        loss_mask_BT=mask_BT,
        advantages_B=torch.tensor([1.0, -1.0, 0.5, -0.5]),
        generator_logprobs_BT=torch.zeros(4, 10),
    )


def test_loads_every_tensor_of_the_checkpoint():
    state = full_state(trainer())
    hf = load_file(TINY / "model.safetensors")
    assert torch.equal(
        state["layers.1.feed_forward.w2.weight"], hf["model.layers.1.mlp.down_proj.weight"]
    )
    assert torch.equal(
        state["layers.0.attention.qkv_linear.wk.weight"],
        hf["model.layers.0.self_attn.k_proj.weight"],
    )
    assert torch.equal(state["tok_embeddings.weight"], hf["model.embed_tokens.weight"])
    assert torch.equal(state["lm_head.weight"], hf["model.embed_tokens.weight"])  # tied


def test_gpt_oss_experts_load_transposed_as_hf_stores_them():
    gpt_oss = REPO / "assets" / "tiny_gpt_oss"
    state = full_state(trainer(name="gpt_oss", hf_checkpoint=str(gpt_oss)))
    hf = load_file(gpt_oss / "model.safetensors")
    experts = "layers.1.moe.routed_experts.inner_experts."
    hf_experts = "model.layers.1.mlp.experts."
    assert torch.equal(state[experts + "mlp1_weight_EGD"], hf[hf_experts + "gate_up_proj"].mT)
    assert torch.equal(state[experts + "mlp2_weight_EDF"], hf[hf_experts + "down_proj"].mT)
    assert torch.equal(state[experts + "mlp2_bias_ED"], hf[hf_experts + "down_proj_bias"])
    assert torch.equal(state["layers.0.attention.sinks"], hf["model.layers.0.self_attn.sinks"])
    assert torch.equal(state["layers.0.moe.router.gate.bias"], hf["model.layers.0.mlp.router.bias"])


def test_an_mxfp4_checkpoint_is_refused_with_the_fix(tmp_path):
    """The released gpt-oss checkpoints store the experts in MXFP4 (`*_blocks`, `*_scales`)."""
    shutil.copytree(REPO / "assets" / "tiny_gpt_oss", tmp_path / "ckpt")
    state = load_file(tmp_path / "ckpt" / "model.safetensors")
    for name in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        weight = state.pop(name)
        state[name + "_blocks"] = torch.zeros(*weight.shape[:2], 4, 16, dtype=torch.uint8)
        state[name + "_scales"] = torch.zeros(*weight.shape[:2], 4, dtype=torch.uint8)
    save_file(state, tmp_path / "ckpt" / "model.safetensors")
    with pytest.raises(ConfigError) as e:
        trainer(name="gpt_oss", hf_checkpoint=str(tmp_path / "ckpt"))
    message = str(e.value)
    assert "is MXFP4-quantized ('model.layers.0.mlp.experts.down_proj_blocks'" in message
    assert "dequantize it to bf16 first" in message and "\n" not in message


def test_wrong_flavor_names_the_first_mismatching_key_and_shapes():
    with pytest.raises(ConfigError) as e:
        trainer(flavor="debugmodel")
    message = str(e.value)
    assert "'model.embed_tokens.weight' has shape (68, 128)" in message
    assert "model.flavor = 'debugmodel' expects (2048, 256)" in message
    assert "\n" not in message


def test_missing_tensor_is_named(tmp_path):
    shutil.copytree(TINY, tmp_path / "ckpt")
    state = load_file(tmp_path / "ckpt" / "model.safetensors")
    del state["model.layers.1.self_attn.k_norm.weight"]
    save_file(state, tmp_path / "ckpt" / "model.safetensors")
    with pytest.raises(ConfigError, match="lacks 'model.layers.1.self_attn.k_norm.weight'"):
        trainer(hf_checkpoint=str(tmp_path / "ckpt"))


def test_unknown_tensor_is_named(tmp_path):
    shutil.copytree(TINY, tmp_path / "ckpt")
    state = load_file(tmp_path / "ckpt" / "model.safetensors")
    state["model.layers.2.mlp.up_proj.weight"] = torch.zeros(256, 128)
    save_file(state, tmp_path / "ckpt" / "model.safetensors")
    with pytest.raises(ConfigError, match="has 'model.layers.2.mlp.up_proj.weight', unknown"):
        trainer(hf_checkpoint=str(tmp_path / "ckpt"))


def test_multi_token_prediction_layers_of_a_checkpoint_are_left_unread(tmp_path):
    """The tiny DeepSeek-V3 checkpoint holds a multi-token-prediction layer past the decoder's
    (`model.layers.2`, as DeepSeek-V3's `model.layers.61`; config.json's
    `num_nextn_predict_layers` = 1): the model loads without it (it is not trained, and vLLM
    serves the decoder without it). The same tensors in a checkpoint that declares no such
    layer are unknown, as before."""
    folder = REPO / "assets" / "tiny_deepseek_v3"
    state = load_file(folder / "model.safetensors")
    assert "model.layers.2.eh_proj.weight" in state
    loaded = full_state(trainer(name="deepseek_v3", flavor="tiny", hf_checkpoint=str(folder)))
    bias = state["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert torch.equal(loaded["layers.1.moe.expert_bias_E"], bias)
    assert not [k for k in loaded if k.startswith(("layers.2.", "mtp_layers"))]
    shutil.copytree(folder, tmp_path / "undeclared")
    config = json.loads((folder / "config.json").read_text())
    del config["num_nextn_predict_layers"]
    (tmp_path / "undeclared" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="has 'model.layers.2.[a-z_.]+', unknown to"):
        trainer(name="deepseek_v3", flavor="tiny", hf_checkpoint=str(tmp_path / "undeclared"))


def test_a_vision_language_checkpoints_vision_tower_is_left_unread_and_exported(tmp_path):
    """Muse Glimmer's checkpoints are a vision-language model's: the text tower under
    `model.language_model.`, the vision tower beside it. The trainer loads the text tower and
    leaves the vision tower unread (the tiny checkpoint has none: a copy gets three of its
    tensors); the HF export writes the trained text tower and copies the vision tower as is."""
    shutil.copytree(REPO / "assets" / "tiny_muse_glimmer", tmp_path / "ckpt")
    state = load_file(tmp_path / "ckpt" / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    vision = {
        "model.vision_tower.ln_pre.weight": torch.randn(32, generator=g),
        "model.vision_adapter.fc1.weight": torch.randn(64, 128, generator=g),
        "model.vision_projection.weight": torch.randn(128, 64, generator=g),
    }
    save_file(state | vision, tmp_path / "ckpt" / "model.safetensors")
    policy = trainer(name="muse_glimmer", flavor="tiny", hf_checkpoint=str(tmp_path / "ckpt"))
    loaded = full_state(policy)
    embedding = state["model.language_model.embed_tokens.weight"]
    assert torch.equal(loaded["tok_embeddings.embedding.weight"], embedding)
    assert not [k for k in loaded if "vision" in k]
    export_hf(loaded, policy.spec, str(tmp_path / "ckpt"), str(tmp_path / "ckpt"), tmp_path / "hf")
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    assert exported.keys() == state.keys() | vision.keys()
    assert all(torch.equal(exported[k], v) for k, v in vision.items())


def test_an_fp8_checkpoint_is_refused_with_the_fix(tmp_path):
    """The released DeepSeek-V3 and Kimi K2 store their linears in FP8 with block scales."""
    shutil.copytree(REPO / "assets" / "tiny_deepseek_v3", tmp_path / "ckpt")
    state = load_file(tmp_path / "ckpt" / "model.safetensors")
    state["model.layers.0.self_attn.o_proj.weight_scale_inv"] = torch.ones(1, 1)
    save_file(state, tmp_path / "ckpt" / "model.safetensors")
    with pytest.raises(ConfigError) as e:
        trainer(name="deepseek_v3", flavor="tiny", hf_checkpoint=str(tmp_path / "ckpt"))
    assert str(e.value) == (
        f"model.hf_checkpoint = {str(tmp_path / 'ckpt')!r} is FP8-quantized "
        "('model.layers.0.self_attn.o_proj.weight_scale_inv', as the released DeepSeek-V3 and "
        "Kimi K2): convert it to bf16 first (docs/moe.md, DeepSeek-V3)"
    )


def test_checkpoint_without_safetensors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({}))
    with pytest.raises(ConfigError, match="has no \\*.safetensors files"):
        trainer(flavor="tiny", hf_checkpoint=str(tmp_path))


def test_bfloat16_computes_in_bf16_with_fp32_master_weights():
    t = trainer(dtype="bfloat16")
    assert {p.dtype for p in t.model.parameters()} == {torch.float32}
    logprobs_BT, _ = t.logprobs(batch().tokens_BT)
    fp32_BT, _ = trainer().logprobs(batch().tokens_BT)
    assert logprobs_BT.dtype == torch.float32
    assert not torch.equal(logprobs_BT, fp32_BT)  # really computed in bf16
    torch.testing.assert_close(logprobs_BT, fp32_BT, rtol=0, atol=5e-2)


def nan_loss(logprobs_BT, micro, scale):
    return logprobs_BT.sum() * float("nan"), {}


def inf_grad_loss(logprobs_BT, micro, scale):
    # sqrt at 0: the loss is 0, its gradient is infinite.
    u = logprobs_BT[0, 6] - logprobs_BT[0, 6].detach()
    return torch.sqrt(u), {}


@pytest.mark.parametrize(
    "loss_fn, message",
    [(nan_loss, "step 1: the loss is nan"), (inf_grad_loss, "step 1: the gradient of ")],
)
def test_non_finite_step_stops_without_touching_weights(loss_fn, message):
    t = trainer()
    before = full_state(t)
    with pytest.raises(NonFiniteError, match=message):
        t.optimizer_step(batch(), loss_fn)
    after = full_state(t)
    assert all(torch.equal(before[k], after[k]) for k in before)


def pg_loss(logprobs_BT, micro, scale):
    weighted = micro.advantages_B[:, None] * logprobs_BT * micro.loss_mask_BT
    return -weighted.sum() / scale.tokens, {}


def test_lr_warms_up_then_decays():
    t = trainer(training=TrainingSection(lr=1e-3, warmup_steps=2, steps=4, lr_decay="linear"))
    lrs = [t.optimizer_step(batch(), pg_loss).metrics["lr"] for _ in range(4)]
    # torchtitan's schedule: linear warm-up to the peak, then a linear decay towards 0.
    assert lrs[:2] == pytest.approx([5e-4, 1e-3])
    assert lrs[1] >= lrs[2] > lrs[3] > 0
    constant = trainer(training=TrainingSection(lr=1e-3, steps=3))
    assert [constant.optimizer_step(batch(), pg_loss).metrics["lr"] for _ in range(3)] == [1e-3] * 3


def test_the_correction_bias_moves_toward_balanced_loads_only_when_asked():
    """training.expert_bias_update_rate: each optimizer step moves every router's bias by the
    rate per expert, up for the experts that got fewer tokens than the mean and down for the
    others (torchtitan's update, centred), and resets the counts; 0 leaves the checkpoint's
    bias. Kimi's model (keyword-only forward) trains through the same calls."""
    rate = 1e-2
    for name in ("deepseek_v3", "kimi_k2_7"):
        checkpoint = str(REPO / "assets" / f"tiny_{name}")
        frozen = trainer(name=name, flavor="tiny", hf_checkpoint=checkpoint)
        moving = trainer(
            name=name,
            flavor="tiny",
            hf_checkpoint=checkpoint,
            training=TrainingSection(lr=1e-3, expert_bias_update_rate=rate),
        )
        before = full_state(moving)["layers.1.moe.expert_bias_E"]
        frozen.optimizer_step(batch(), pg_loss)
        moe = moving.model.layers["1"].moe
        moving.logprobs(batch().tokens_BT)  # counted too: only the signs matter
        moving.optimizer_step(batch(), pg_loss)
        assert torch.equal(full_state(frozen)["layers.1.moe.expert_bias_E"], before)
        step = full_state(moving)["layers.1.moe.expert_bias_E"] - before
        assert step.abs().max() > 0.5 * rate and abs(float(step.sum())) < 1e-6, step
        assert moe.tokens_per_expert_E.sum() == 0  # counted afresh for the next step


def test_updating_the_bias_is_refused_where_the_export_would_lose_it():
    from torchtitan_rl.config import parse_args

    base = ["--job.config_file", str(REPO / "run_configs" / "debug_cpu.toml")]
    with pytest.raises(ConfigError) as e:
        parse_args(
            [*base, "--model.flavor", "tiny_moe", "--training.expert_bias_update_rate", "1e-3"]
        )
    assert str(e.value) == (
        "training.expert_bias_update_rate = 0.001: qwen3's HF checkpoints have no router bias, "
        "so the export would lose what it learns: set it to 0, or train a family whose "
        "checkpoints keep one (deepseek_v3, kimi_k2_7)"
    )
    flags = [*base, "--model.name", "deepseek_v3", "--model.flavor", "tiny"]
    config = parse_args([*flags, "--training.expert_bias_update_rate", "1e-3"])
    assert config.training.expert_bias_update_rate == 1e-3
    with pytest.raises(ConfigError, match="must be >= 0"):
        parse_args([*flags, "--training.expert_bias_update_rate", "-1"])


# ---- a step on a GPU's terms: host reads and GEMM dtypes --------------------------------------


def ragged(rows: int = 8) -> RolloutBatch:
    """Rows of 6 to 20 tokens, the last 1 to 10 of them sampled."""
    g = torch.Generator().manual_seed(3)
    tokens_BT = torch.randint(3, 64, (rows, 20), generator=g)
    mask_BT = torch.zeros(rows, 20)
    for b in range(rows):
        end = 6 + (b * 5) % 15
        mask_BT[b, end - 1 - b % 10 : end] = 1.0
    return RolloutBatch(
        tokens_BT=tokens_BT,
        loss_mask_BT=mask_BT,
        advantages_B=torch.linspace(-1, 1, rows),
        generator_logprobs_BT=torch.zeros(rows, 20),
    )


def counted_step(training: TrainingSection) -> tuple[int, dict]:
    """(micro-batches, calls that read a tensor on the host by (call, caller)) of the second
    optimizer step of a fresh trainer on `ragged()` with the project's policy loss."""
    from helpers.host_syncs import HostSyncs

    from torchtitan_rl.algorithms.losses import PolicyLoss

    loss = PolicyLoss(
        clip_low=0.2, clip_high=0.2, aggregation="token_mean", max_tokens=20, kl_beta=0.1
    )
    t = trainer(training=training)
    data = ragged()
    data.reference_logprobs_BT = torch.zeros(8, 20)
    t.optimizer_step(data, loss)  # the first builds the optimizer's state
    with HostSyncs() as syncs:
        t.optimizer_step(data, loss)
    return len(t.plan(data)), dict(syncs.counts)


@pytest.mark.parametrize("packed", [True, False])
def test_a_step_reads_the_device_once_however_many_micro_batches(packed):
    """Issue 66: on a GPU every host read of a device tensor waits for the queue. A step plans
    on the host from the loss mask (`HOST_PLANNERS`), then runs its micro-batches without a
    read, and reads its figures (gradient norm, loss, entropy, non-finite logprobs, the loss's
    metrics) once, with one `.cpu()` (its `.tolist()`s are of host tensors: the read and the
    metric totals all-reduced on gloo). The optimizer's own reads are of its host step
    counters (for-loop AdamW on CPU). The same calls, however many micro-batches: 1 or 4."""
    if packed:
        one, four = TrainingSection(micro_batch_tokens=200), TrainingSection(micro_batch_tokens=24)
    else:
        one = TrainingSection(micro_batch_tokens=0, micro_batches=1)
        four = TrainingSection(micro_batch_tokens=0, micro_batches=4)
    (n_one, calls_one), (n_four, calls_four) = counted_step(one), counted_step(four)
    assert (n_one, n_four) == (1, 4)
    assert calls_four == calls_one
    step = {
        (call, caller): n
        for (call, caller), n in calls_one.items()
        if caller not in HOST_PLANNERS and not caller.startswith("library")
    }
    assert step == {
        ("cpu", "policy_trainer.optimizer_step"): 1,
        ("tolist", "policy_trainer.optimizer_step"): 2,
    }


def test_the_bf16_heads_gradients_are_fp32_autograds_within_bf16_rounding():
    """The fused head alone, its inputs in bf16, several chunks, temperature 0.7: d hidden and
    d weight are fp32 autograd's on the same (bf16-valued) inputs within 1e-2 of their scale
    (measured: 3.6e-3 and 3.2e-3, bf16 rounding of d logits before the bf16 GEMMs). The
    whole-model bound below (rtol 0.1) would let a wrong head backward through; this one
    does not (planted: the 1 / T dropped from d logits, d hidden is 0.30 of its scale off)."""
    from torchtitan_rl.trainer.logprobs import head_logprobs

    g = torch.Generator().manual_seed(0)
    tokens, dim, vocab, temperature = 48, 64, 512, 0.7
    hidden_ND = torch.randn(tokens, dim, generator=g).bfloat16().requires_grad_()
    weight_VD = (torch.randn(vocab, dim, generator=g) * 0.2).bfloat16().requires_grad_()
    targets_N = torch.randint(0, vocab, (tokens,), generator=g)
    weights_N = torch.randn(tokens, generator=g)
    logprobs_N, _ = head_logprobs(hidden_ND, weight_VD, targets_N, temperature, chunk=16)
    (weights_N * logprobs_N).sum().backward()
    hidden32, weight32 = (x.detach().float().requires_grad_() for x in (hidden_ND, weight_VD))
    logits_NV = hidden32 @ weight32.T / temperature
    reference_N = logits_NV.log_softmax(-1).gather(1, targets_N[:, None])[:, 0]
    (weights_N * reference_N).sum().backward()
    for ours, exact in ((hidden_ND.grad, hidden32.grad), (weight_VD.grad, weight32.grad)):
        assert ours.dtype == torch.bfloat16
        assert (ours.float() - exact).abs().max() <= 1e-2 * exact.abs().max()


def test_a_bf16_step_runs_every_head_gemm_in_bf16():
    """Where the model computes in bf16, the fused head's forward and backward GEMMs over the
    vocabulary run in bf16 (tensor cores on a GPU), with fp32 only in the softmax and the
    weight gradient's sum; the gradients match an fp32 step's within bf16's rounding."""
    from torch.utils._python_dispatch import TorchDispatchMode

    vocab = json.loads((TINY / "config.json").read_text())["vocab_size"]
    gemms = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}

    class Gemms(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.dtypes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in gemms and vocab in {d for a in args[-2:] for d in a.shape}:
                self.dtypes.append(args[-1].dtype)
            return func(*args, **(kwargs or {}))

    grads = {}
    for dtype in ("bfloat16", "float32"):
        t = trainer(dtype=dtype, training=TrainingSection(micro_batch_tokens=200))
        with recorded_grads(t) as grads[dtype], Gemms() as seen:
            t.optimizer_step(ragged(), pg_loss)
        # Forward: one projection; backward: d hidden and d weight (a small vocabulary: one
        # chunk, whose log_softmax the forward keeps).
        assert seen.dtypes == [getattr(torch, dtype)] * 3, (dtype, seen.dtypes)
    assert grads["float32"].keys() == grads["bfloat16"].keys()
    for name, grad in grads["float32"].items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(grads["bfloat16"][name], grad, rtol=0.1, atol=2e-3)
