"""Disaggregated placement: 1 trainer rank + 1 generator rank under torchrun, k = 0 and 1.
k = 0 with DAPO, preempted and resumed: tests/integration/test_long_runs.py.

.venv/bin/python -m pytest tests/integration/test_disaggregated.py

Real runs: torchrun with 2 ranks, the trainer's FSDP mesh on rank 0, the vLLM engine in the
generator rank's child process, weights broadcast over gloo.
"""

import json

from helpers import runs
from helpers.launch import metric_rows, run_train
from safetensors.torch import load_file

from torchtitan_rl.loop import PLACEMENT_METRICS

DISAGGREGATED = (
    "--job.config_file",
    "run_configs/debug_cpu.toml",
    "--generator.placement",
    "disaggregated",
    "--generator.verify_weight_sync",
    "true",
)


def test_off_policy_k2_with_the_correction_learns_with_bounded_age_and_bitwise_weights(tmp_path):
    result = run_train(
        *DISAGGREGATED,
        "--algorithm.max_offpolicy_steps",
        "2",
        "--job.dump_folder",
        str(tmp_path),
        nproc=2,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = metric_rows(tmp_path)
    assert [row["step"] for row in metrics] == list(range(1, 101))
    # Every transfer: the generator's weights hash to the trainer's, bit for bit.
    assert {row["weight_sync/verified"] for row in metrics} == {1.0}
    # No rollout trained at an age above k = 2; from step 3 on every one is exactly 2.
    assert [row["policy_age/max"] for row in metrics] == [0.0, 1.0] + [2.0] * 98
    assert all(r["rollout_version/min"] == max(r["step"] - 3, 0) for r in metrics)
    # The correction is on by default off-policy (tis) and says what it did: stale samples
    # have ratios away from 1 and a KL(behaviour || old) above 0.
    assert all("offpolicy/truncated_fraction" in r for r in metrics)
    assert max(r["offpolicy/ratio_max"] for r in metrics) > 1.01
    assert sum(r["offpolicy/kl"] for r in metrics[2:]) > 0
    first, last = metrics[:5], metrics[-10:]
    assert sum(r["reward/mean"] for r in first) / 5 < 0.2
    # Measured with the 68-token tiny checkpoint: 0.865, a plateau from step 70 (colocated,
    # the same run reaches 0.996; with the earlier 64-token checkpoint this was above 0.9).
    assert sum(r["reward/mean"] for r in last) / 10 > 0.8


def test_two_trainer_ranks_with_fsdp_and_two_generator_ranks_that_evaluate(tmp_path):
    """4 ranks: FSDP over the 2 trainers, each taking the rollouts of one generator rank. The
    2 generator ranks run one engine, tensor parallel: their children form a world of their
    own, each receives the whole weights and keeps its shard, and each rank sends its half of
    the engine's rollouts. The policy is LoRA's: after the starting weights each broadcast
    carries only the merged adapted linears, resharded. The engine evaluates the held-out set
    with each due policy version, counted once."""
    result = run_train(
        *DISAGGREGATED,
        *("--generator.parallelism.tensor_parallel_degree", "2", "--lora.enable", "true"),
        *("--task.name", "dataset", "--task.dataset_path", "data/arith/train.jsonl"),
        *("--eval.dataset_path", "data/arith/test.parquet", "--eval.interval", "2"),
        "--generator.num_ranks",
        "2",
        "--algorithm.max_offpolicy_steps",
        "1",
        "--training.steps",
        "4",
        "--checkpoint.enable",
        "true",
        "--checkpoint.interval",
        "2",
        "--job.dump_folder",
        str(tmp_path),
        nproc=4,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = metric_rows(tmp_path)
    assert {row["weight_sync/verified"] for row in metrics} == {1.0}
    # The tiny Qwen3's 10 adapted linears, fp32: 1179648 of its 1217536 bytes.
    assert {row["weight_sync/bytes"] for row in metrics} == {1179648.0}
    assert [row["policy_age/max"] for row in metrics] == [0.0, 1.0, 1.0, 1.0]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-2", "step-4"]
    # Version 0 before step 1; version 2 taken before sampling step 4 (k = 1), sent with that
    # rollout; version 4, the last, in the generators' message after the last step.
    evaluations = metric_rows(tmp_path, "eval")
    assert [(r["step"], r["eval/policy_version"]) for r in evaluations] == [(1, 0), (4, 2), (4, 4)]
    assert {r["eval/prompts"] for r in evaluations} == {36.0}  # the engine's, once
    for row in metrics:  # 32 prompts x 8 samples, each trained once
        assert row["generated_tokens"] / row["response_length/mean"] == 256
    # On policy (step 1: the starting weights on both sides), the sharded engine's logprobs
    # are the trainer's; later rollouts are a version old (k = 1).
    assert metrics[0]["logprob_diff/max"] < 1e-4
    logged = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    # The samples of the generator that sends to trainer rank 0, which logs.
    assert [len(r["samples"]) for r in logged] == [4, 4, 4]


def test_lora_sends_only_adapted_linears_exports_and_logs_the_colocated_names(lora_run, tmp_path):
    """The LoRA run of tests/integration/test_lora.py, disaggregated: after the starting
    weights, each broadcast carries only the merged adapted linears (the colocated rule), the
    run ends with the HF export, and its metrics are the colocated run's plus the short list
    only a disaggregated run logs."""
    result = run_train(
        *runs.LORA,
        *("--generator.placement", "disaggregated", "--generator.verify_weight_sync", "true"),
        *("--job.dump_folder", str(tmp_path)),
        nproc=2,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metric_rows(tmp_path)
    assert [row["step"] for row in rows] == list(range(1, 7))
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    adapted = sum(t.numel() * 4 for n, t in exported.items() if n.split(".")[-2] in ADAPTED_HF)
    assert {row["weight_sync/bytes"] for row in rows} == {float(adapted)}
    assert {row["weight_sync/verified"] for row in rows} == {1.0}
    assert {row["logprob_diff/max"] for row in rows} == {0.0}  # batch-invariant, k = 0
    runs.assert_distilled_from_an_equal_start(rows)  # the teacher on the trainer rank
    colocated = set(metric_rows(lora_run)[0])  # verify_weight_sync off there
    only_here = set(PLACEMENT_METRICS["disaggregated"]) | {"weight_sync/verified"}
    assert set(rows[0]) == colocated | only_here
    assert not colocated & only_here


# The HF names of the linears LoRA adapts ("all": attention and MLP).
ADAPTED_HF = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
