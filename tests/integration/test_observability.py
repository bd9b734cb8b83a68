"""Observability of the session's reference run: TensorBoard scalars, the W&B offline run,
rollouts.jsonl samples, and scripts/plot_metrics.py.

    .venv/bin/python -m pytest tests/integration/test_observability.py
"""

import json
from pathlib import Path

import pytest
from helpers.launch import metric_rows, run_script


@pytest.fixture
def run(reference_run) -> Path:
    """The session's reference run (2 ranks): TensorBoard, W&B offline, every step's rollouts
    logged, a KL penalty (tests/helpers/runs.py)."""
    return reference_run.folder


def test_tensorboard_gets_every_metric_every_step(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = (run / "tb").iterdir()
    accumulator = EventAccumulator(str(events))
    accumulator.Reload()
    assert {"reward/mean", "kl", "logprob_diff/max", "time/step_s"} <= set(
        accumulator.Tags()["scalars"]
    )
    rewards = accumulator.Scalars("reward/mean")
    metrics = metric_rows(run)
    assert [e.step for e in rewards] == [1, 2, 3, 4, 5, 6]
    assert [e.value for e in rewards] == pytest.approx([m["reward/mean"] for m in metrics])


def test_wandb_offline_run_gets_every_metric_every_step(run):
    (run_file,) = (run / "wandb").glob("offline-run-*/run-*.wandb")
    assert run_file.stem == "run-" + (run / "wandb_run_id").read_text().strip()
    records = run_file.read_bytes()
    # Each step's history record names every metric it carries.
    for key in (b"reward/mean", b"logprob_diff/max", b"kl"):
        assert records.count(key) >= 6, key
    assert b"debug_cpu" in records  # the run's config went along


def test_rollouts_hold_prompts_completions_rewards_and_token_diffs(run):
    lines = (run / "rollouts.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4, 5, 6]
    for line in lines:
        samples = json.loads(line)["samples"]
        assert len(samples) == 4
        for sample in samples:
            assert sample["prompt"].startswith("echo ") and 0.0 <= sample["reward"] <= 1.0
            n = len(sample["token_ids"])
            assert n >= 1 and len(sample["generator_logprobs"]) == len(sample["logprob_diff"]) == n
            assert max(abs(d) for d in sample["logprob_diff"]) <= 1e-5


def test_plot_metrics_draws_the_logged_curves(run, tmp_path):
    out = tmp_path / "curves.png"
    result = run_script("plot_metrics.py", str(run / "metrics.jsonl"), "-o", str(out))
    assert result.returncode == 0, result.stderr
    assert out.stat().st_size > 10_000
    assert "kl" in result.stdout and "logprob_diff/max" in result.stdout

    # Without a KL penalty there is no KL curve.
    rows = metric_rows(run)
    no_kl = tmp_path / "no_kl.jsonl"
    no_kl.write_text("\n".join(json.dumps({k: v for k, v in r.items() if k != "kl"}) for r in rows))
    result = run_script("plot_metrics.py", str(no_kl), "-o", str(tmp_path / "b.png"))
    assert result.returncode == 0 and "kl," not in result.stdout
