"""The GRPO loop end to end (torchrun, real vLLM, real FSDP): the session's reference run, TP
and sleep mode against it, hooks in both placements. Building blocks: tests/unit/.

    .venv/bin/python -m pytest tests/integration/test_rl_trainer.py
"""

import json
import math

import pytest
from helpers import runs
from helpers.launch import metric_rows, run_dist, run_train

CONTRACT = [
    "step",
    "reward/mean",
    "reward/std",
    "response_length/mean",
    "loss",
    "entropy",
    "clip_fraction",
    "logprob_diff/max",
    "logprob_diff/mean",
    "policy_version",
    "time/generate_s",
    "time/train_s",
    "time/weight_sync_s",
    "weight_sync/bytes",
    "time/step_s",
    "throughput/generated_tokens_per_s",
]


@pytest.fixture
def demo(reference_run):
    """The session's reference run: its dump folder, metric rows and console."""
    folder = reference_run.folder
    return folder, metric_rows(folder), reference_run.result.stdout


# The reference run's numerics for 2 steps, without its checkpoints and export.
TWO_STEPS = (
    *runs.REFERENCE,
    *("--training.steps", "2", "--checkpoint.enable", "false"),
    *("--checkpoint.export_hf_at_end", "false"),
)


def test_metrics_follow_the_contract(demo):
    _, rows, _ = demo
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    for row in rows:
        assert set(CONTRACT) <= set(row), set(CONTRACT) - set(row)
        assert all(math.isfinite(row[k]) for k in CONTRACT)
        assert 0.0 <= row["reward/mean"] <= 1.0
        assert row["response_length/mean"] > 0
        assert row["time/step_s"] >= row["time/generate_s"] + row["time/train_s"]


def test_policy_version_increments_every_step(demo):
    _, rows, _ = demo
    assert [r["policy_version"] for r in rows] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]


def test_generator_and_trainer_agree_before_each_update(demo):
    _, rows, _ = demo
    assert all(r["logprob_diff/max"] <= 1e-5 for r in rows)


def test_tensor_parallel_loop_takes_the_same_steps_as_fsdp(demo, tmp_path):
    """TP=2 on the 2 ranks: each rank samples its own share of the prompts (as under FSDP=2),
    the TP group trains on their union, and weight sync gathers the TP shards. Same prompts,
    seeds and starting weights as the FSDP=2 demo, so the same samples and the same update."""
    result = run_train(
        *TWO_STEPS,
        *("--parallelism.tp", "2", "--job.dump_folder", str(tmp_path)),
        nproc=2,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    tp_rows = metric_rows(tmp_path)
    fsdp_rows = demo[1]
    first, fsdp_first = tp_rows[0], fsdp_rows[0]
    for key in ("reward/mean", "response_length/mean", "generated_tokens"):
        assert first[key] == fsdp_first[key], key
    for key in ("grad_norm", "entropy"):
        assert first[key] == pytest.approx(fsdp_first[key], rel=1e-4), key
    # seq_mean_token_mean at ratio 1: each group's advantages sum to 0, so the loss is 0 up to
    # rounding on both layouts.
    assert first["loss"] == pytest.approx(fsdp_first["loss"], abs=1e-7)
    # The synced weights are the TP policy's: the generator agrees with it after the step.
    assert tp_rows[1]["logprob_diff/max"] <= 1e-5
    assert tp_rows[1]["policy_version"] == 2.0


def test_sleep_mode_changes_no_figure_of_the_run(demo, tmp_path):
    """Freeing the generator's weights during training and re-allocating them for the sync
    leaves the run exactly as it was: same rewards, losses and generator/trainer agreement."""
    result = run_train(
        *TWO_STEPS,
        *("--generator.enable_sleep_mode", "true", "--job.dump_folder", str(tmp_path)),
        nproc=2,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    rows = metric_rows(tmp_path)
    for row, awake in zip(rows, demo[1][:2], strict=True):
        for key in ("reward/mean", "response_length/mean", "loss", "grad_norm"):
            assert row[key] == awake[key], key
        assert row["logprob_diff/max"] <= 1e-5


def test_run_writes_its_files_and_a_line_per_step(demo):
    dump, _, stdout = demo
    assert (dump / "config.toml").is_file()
    assert (dump / "reward_curve.png").stat().st_size > 1000
    lines = stdout.splitlines()
    assert sum(line.startswith("step ") for line in lines) == 6 and "reward " in stdout
    assert any(line.startswith("done: trained to step 6 in ") for line in lines)


@pytest.mark.parametrize(
    "placement, nproc", [("colocated", 0), ("disaggregated", 2)], ids=["colocated", "disaggregated"]
)
def test_hooks_fire_in_order_and_kl_grows_from_zero(placement, nproc, tmp_path):
    # Colocated with sleep mode: the generator's weights are freed while the trainer trains.
    sleep = ["--generator.enable_sleep_mode", "true"] if placement == "colocated" else []
    run_dist(
        "rl_hooks_run.py", str(tmp_path), "--generator.placement", placement, *sleep, nproc=nproc
    )
    calls = json.loads((tmp_path / "hooks.json").read_text())
    assert [c[:2] for c in calls] == [
        [name, step]
        for step in (1, 2)
        for name in ("before_step", "after_train", "after_sync", "after_step")
    ]
    assert "loss" in calls[1][2] and calls[2][2] == 1 and calls[7][2] == 2.0
    # KL to the frozen reference: 0 while the policy is the reference, > 0 once step 1 (whose
    # 256 samples include some rewarded ones) has moved the policy.
    assert calls[3][3] == 0.0 and calls[7][3] > 0
    if placement == "colocated":
        # One forward of the policy per step (the pre-update logprobs come from the training
        # forward, no extra scoring pass) and one of the reference.
        forwards = json.loads((tmp_path / "forwards.json").read_text())
        assert forwards == [{"policy": 1, "reference": 1}] * 2
        assert json.loads((tmp_path / "generator_numel.json").read_text()) == [0, 0]
