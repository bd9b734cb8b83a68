"""A mixture-of-experts policy end to end (tests/helpers/runs.py: MOE): the tiny Qwen3-MoE
with its experts split over 2 ranks (EP = 2), the real vLLM engine running the same torchtitan
MoE over both ranks (generator EP = 2), weight sync verified every step, the routers' bias
carried to the generator, and the HF export read by vLLM's own Qwen3MoeForCausalLM. Bitwise
MoE logprobs under batch-invariant mode: test_batch_invariant.py; exact resume: test_resume.py.

    .venv/bin/python -m pytest tests/integration/test_moe.py

Real runs: torchrun with 2 ranks, torchtitan's all-to-all expert dispatch over gloo.
"""

import json

import torch
from helpers import runs
from helpers.launch import DEBUG_TOML, REPO, metric_rows, run_dist, run_helper
from helpers.titan import torchtitan_logits
from safetensors.torch import load_file


def test_moe_run_trains_with_experts_split_over_the_ranks(moe_run):
    rows = metric_rows(moe_run)
    assert [row["step"] for row in rows] == list(range(1, 7))
    # Trainer and generator run the same MoE: they agree to float rounding every step (every
    # weight sync compared by digest: generator.verify_weight_sync, a mismatch stops the run).
    assert max(row["logprob_diff/max"] for row in rows) < 1e-4
    assert all(row["kl"] >= 0 for row in rows) and rows[-1]["kl"] > 0
    checks = json.loads((moe_run / "moe.json").read_text())
    # Expert parallel: each rank holds 4 of the 8 experts of every layer, in the trainer and
    # in the generator.
    assert checks["expert_shards"] == [[4, 64, 128], [8, 64, 128]]
    assert checks["generator_expert_shards"] == [[4, 64, 128], [8, 64, 128]]
    # The generator's routing, gathered from both ranks, is the trainer's (fp32).
    assert all(row["moe/routing_compared"] > 1000 for row in rows)
    assert max(row["moe/routing_mismatch"] for row in rows) < 1e-3
    # Every trained tensor is synced each step, experts and routers included; the frozen
    # router bias only by the first sync.
    synced = checks["synced_each_step"]
    assert "layers.1.moe.routed_experts.inner_experts.w2_EDF" in synced
    assert "layers.0.moe.router.gate.weight" in synced
    assert not [name for name in synced if "expert_bias" in name]


def test_the_router_bias_reaches_the_generator(moe_run):
    """Made nonzero in the trainer (as a torchtitan-pretrained checkpoint holds it), the bias
    reaches the generator's buffers, moves routing, and both sides still agree."""
    checks = json.loads((moe_run / "moe.json").read_text())
    assert checks["bias_names"] == ["layers.0.moe.expert_bias_E", "layers.1.moe.expert_bias_E"]
    assert checks["bias_synced"] and checks["bias_moved_logprobs"]
    assert checks["bias_diff_before"] < 1e-4 and checks["bias_diff_after"] < 1e-4


def test_exported_moe_policy_matches_vllm_native_qwen3_moe(moe_run):
    """vLLM's own Qwen3MoeForCausalLM (its fused MoE, not our wrapper) loads the export, picks
    the generator's greedy tokens, and reports the torchtitan model's logprobs for them."""
    export = moe_run / "hf"
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["num_experts"] == 8
    start = load_file(REPO / "assets" / "tiny_moe_qwen3" / "model.safetensors")
    trained = load_file(export / "model.safetensors")
    assert trained.keys() == start.keys()
    assert any(not torch.equal(t, start[k]) for k, t in trained.items() if ".experts." in k)

    native = run_helper("vllm_greedy.py", str(export), runs.GREEDY_PROMPT, str(runs.GREEDY_TOKENS))
    out = json.loads(native.stdout.splitlines()[-1])
    generator_tokens = json.loads((moe_run / "moe.json").read_text())["greedy"]
    assert out["token_ids"][: len(generator_tokens)] == generator_tokens

    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(export / "tokenizer.json")).encode(runs.GREEDY_PROMPT).ids
    logprobs_TV = torch.log_softmax(
        torchtitan_logits(str(export), ids + out["token_ids"], "tiny_moe"), dim=-1
    )
    for i, token in enumerate(out["token_ids"]):
        assert abs(float(logprobs_TV[len(ids) - 1 + i, token]) - out["logprobs"][i]) < 1e-4


def test_router_replay_removes_the_routing_mismatch_and_narrows_logprobs(tmp_path):
    """bf16, batch-invariant mode off: the generator's and the trainer's kernels round
    differently, so near-tied router scores route some tokens to other experts. With
    algorithm.router_replay the loop's every step reports no mismatch; on a fresh batch after
    training, replay off mismatches and replay on neither mismatches nor differs as much.
    The run is also LoRA (attention adapters: experts and routers frozen, so each step's sync
    sends the merged attention weights alone) with activation checkpointing (the backward's
    recompute replays the forward's routing)."""
    out = tmp_path / "run"
    run_dist(
        "moe_run.py",
        runs.GREEDY_PROMPT,
        str(runs.GREEDY_TOKENS),
        *("--job.config_file", DEBUG_TOML, *runs.MOE_MODEL, "--training.steps", "3"),
        *("--model.dtype", "bfloat16", "--generator.dtype", "bfloat16"),
        *("--algorithm.router_replay", "true", "--lora.enable", "true"),
        *("--training.activation_checkpoint", "full", "--training.lr", "1e-2"),
        *("--job.dump_folder", str(out)),
        nproc=2,
    )
    rows = metric_rows(out)
    assert [row["moe/routing_mismatch"] for row in rows] == [0.0] * 3
    assert all(row["moe/routing_compared"] > 1000 for row in rows)
    off, on = (json.loads((out / "moe.json").read_text())["replay"][k] for k in ("off", "on"))
    assert off["compared"] == on["compared"] > 1000
    assert off["mismatched"] > 0 and on["mismatched"] == 0, (off, on)
    synced = json.loads((out / "moe.json").read_text())["synced_each_step"]
    assert len(synced) == 4 and all(".attention." in name for name in synced), synced
    # Tokens routed alike compute alike either way; the flipped ones now match.
    assert on["diff_mean"] < off["diff_mean"] and on["diff_max"] <= off["diff_max"], (off, on)
