"""Evaluation in a real run (2 ranks), reproduced exactly by scripts/eval.py on the export.

.venv/bin/python -m pytest tests/integration/test_eval.py
"""

import json

import pytest
from helpers.launch import run_script, run_train


def test_the_run_evaluates_and_scripts_eval_reproduces_it_on_the_export(tmp_path):
    """A colocated run of the arithmetic demo (3 steps) evaluates sampled completions (n = 4,
    temperature 1) at the start and the end; scripts/eval.py on the exported policy, with the
    run's config and as many ranks, gives the same figures exactly: the same samples.

    Both run one generator over the 2 ranks, tensor parallel (the run's config.toml carries
    generator.parallelism.tensor_parallel_degree = 2 to the script): the ranks sample the same
    prompts, each trains on half of them, and each evaluation and rollout is counted once."""
    dump = tmp_path / "run"
    sampled = ("--eval.n", "4", "--eval.temperature", "1.0", "--eval.interval", "0")
    result = run_train(
        *("--job.config_file", "run_configs/arith_cpu.toml", "--job.dump_folder", str(dump)),
        *("--training.steps", "3", *sampled),
        *("--generator.parallelism.tensor_parallel_degree", "2"),
        nproc=2,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    for row in steps:  # 32 prompts x 8 samples, once each; the two sides agree
        assert row["generated_tokens"] / row["response_length/mean"] == pytest.approx(256)
        assert row["logprob_diff/max"] < 1e-4
    evaluations = [r for r in rows if "eval/accuracy" in r]
    assert [(r["step"], r["eval/policy_version"]) for r in evaluations] == [(0, 0), (3, 3)]
    last = evaluations[-1]
    assert last["eval/prompts"] == 36 and set(last) >= {"eval/pass@1", "eval/pass@4"}
    assert last["eval/pass@1"] == pytest.approx(last["eval/accuracy"])
    assert "eval    3 | accuracy" in result.stdout
    logged = [json.loads(line) for line in (dump / "eval.jsonl").read_text().splitlines()]
    assert len(logged[-1]["samples"]) == 4 and len(logged[-1]["samples"][0]["completions"]) == 4
    assert logged[-1]["samples"][0]["prompt"].startswith("<|im_start|>user\n")

    scored = run_script(
        "eval.py",
        *(
            "--job.config_file",
            str(dump / "config.toml"),
            "--model.hf_checkpoint",
            str(dump / "hf"),
        ),
        nproc=2,
    )
    assert scored.returncode == 0, scored.stderr[-3000:]
    (line,) = [x for x in scored.stdout.splitlines() if x.startswith("{")]
    again = json.loads(line)
    assert again["checkpoint"] == str(dump / "hf") and again["ranks"] == 2
    for key in ("eval/accuracy", "eval/pass@2", "eval/pass@4", "eval/response_length"):
        assert again[key] == last[key], key
