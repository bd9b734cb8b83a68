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
