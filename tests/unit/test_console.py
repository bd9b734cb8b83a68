"""The console lines of ours and the closing summary, in process. The redirect of library
output to run.log, in real processes: tests/integration/test_launcher.py.

    .venv/bin/python -m pytest tests/unit/test_console.py
"""

import json

from torchtitan_rl import console
from torchtitan_rl.metrics import summary


def test_without_a_redirect_lines_go_to_sys_stdout_and_stderr(capsys):
    console.say("step    1 | reward 0.500")
    console.error("error: something")
    assert capsys.readouterr() == ("step    1 | reward 0.500\n", "error: something\n")


def test_summary_names_reward_eval_and_the_outputs_that_exist(tmp_path):
    rows = [
        {"step": 1, "reward/mean": 0.25},
        {"step": 2, "reward/mean": 0.5},
        {"step": 2, "eval/accuracy": 0.75},
        {"step": 3, "reward/mean": 0.875},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "checkpoints" / "step-3").mkdir(parents=True)
    (tmp_path / "hf").mkdir()
    lines = summary(
        tmp_path, wall_s=61.4, log=tmp_path / "run.log", checkpoints=tmp_path / "checkpoints"
    )
    assert lines == [
        "done: trained to step 3 in 61 s | reward/mean 0.250 at step 1 -> 0.875 at step 3",
        "eval/accuracy 0.750 at step 2",
        f"metrics:     {tmp_path / 'metrics.jsonl'}",
        "all curves:  .venv/bin/python scripts/plot_metrics.py "
        f"{tmp_path / 'metrics.jsonl'} -o {tmp_path}/curves.png",
        f"library log: {tmp_path / 'run.log'}",
        f"checkpoints: {tmp_path / 'checkpoints'}",
        f"HF export:   {tmp_path / 'hf'}",
    ]
    # Not written: no checkpoints, no export, no log (job.verbose) are left out.
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "metrics.jsonl").write_text(json.dumps(rows[0]) + "\n")
    assert len(summary(bare, wall_s=1.0, log=None, checkpoints=bare / "checkpoints")) == 3


def test_an_rl_step_line_shows_what_moves_and_an_sft_line_its_loss(tmp_path, capsys):
    """GRPO's loss is ~0 by construction: an RL step's line shows the gradient's norm (and the
    clip fraction only where several optimizer steps can clip), the throughput of generation
    and training; an SFT step's line shows its loss. The summary gives the run's throughput."""
    from torchtitan_rl.metrics import MetricsLogger

    logger = MetricsLogger(str(tmp_path), enabled=True, total_steps=3, log_interval=1)
    rl = {
        "reward/mean": 0.25,
        "response_length/mean": 12.0,
        "loss": 1e-9,
        "grad_norm": 0.4123,
        "clip_fraction": 0.0,
        "optimizer_steps": 1.0,
        "entropy": 2.0,
        "logprob_diff/max": 4.6e-5,
        "generated_tokens": 1000.0,
        "trained_tokens": 6000.0,
        "time/generate_s": 4.0,
        "time/train_s": 30.0,
        "throughput/generated_tokens_per_s": 250.0,
        "throughput/trained_tokens_per_s": 200.0,
        "time/step_s": 35.0,
    }
    logger.log(1, rl)
    logger.log(2, rl | {"optimizer_steps": 4.0, "clip_fraction": 0.125})
    logger.log(3, {"loss": 1.2345, "grad_norm": 3.0, "time/step_s": 1.0})
    one, four, sft = capsys.readouterr().out.splitlines()
    assert one == (
        "step    1 | reward 0.250 | len 12.0 | grad 0.412 | entropy 2.000 | lp_diff 4.6e-05 | "
        "gen 250 tok/s | train 200 tok/s | 35.00s"
    )
    assert "| grad 0.412 | clip 0.125 | entropy" in four and "loss" not in four
    assert sft == "step    3 | loss 1.2345 | grad 3 | 1.00s"
    (done, *_) = summary(tmp_path, wall_s=70.0, log=None, checkpoints=tmp_path / "checkpoints")
    assert done.endswith("| 250 tokens/s generated, 200 trained")
