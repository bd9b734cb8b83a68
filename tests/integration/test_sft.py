"""SFT warm start: token-budget micro-batches, the session's SFT run (held-out loss, logs), and
an export that the RL run and vLLM load and that answers as the SFT trainer did. The loss
mask and bad rows: tests/unit/test_sft.py; killed and resumed: test_resume.py.

    .venv/bin/python -m pytest tests/integration/test_sft.py

Real runs: torchrun with 2 ranks, the tiny Qwen3 checkpoint and its chat template, and the
real vLLM engine in the RL run that starts from the SFT export.
"""

import json

import pytest
import torch
from helpers.launch import keyed_rows, run_dist, run_train

IM_END = 4  # the tiny checkpoint's <|im_end|>, its first stop id


def test_token_budget_micro_batches_give_the_one_batch_gradient(tmp_path):
    # Rows of 22 to 36 tokens whose seeded order packs rank 0's into 3 micro-batches of at
    # most 80 tokens, rank 1's into 4 (the step then deals them anew by tokens, as RL does).
    answers = ["a" * (1 + (5 * i + 3) % 13) for i in range(8)] + ["a"] * 8
    rows = [{"prompt": "q" * (1 + i % 7), "answer": answers[i]} for i in range(16)]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    run_dist("sft_step_run.py", str(tmp_path), str(data), "80", nproc=2)
    result = torch.load(tmp_path / "result.pt")
    whole, cut = result["whole"], result["cut"]
    assert whole["packed"] == [1, 1]
    assert cut["packed"][0] != cut["packed"][1], "the test rows must pack unevenly"
    # Every rank ran as many micro-batches, each within the budget.
    assert len(cut["tokens"][0]) == len(cut["tokens"][1]) == max(cut["packed"])
    assert all(tokens <= 80 for tokens_R in cut["tokens"] for tokens in tokens_R)
    assert cut["metrics"]["tokens"] == whole["metrics"]["tokens"]
    assert cut["metrics"]["loss"] == pytest.approx(whole["metrics"]["loss"], rel=1e-6)
    for name, grad in whole["grads"].items():
        torch.testing.assert_close(cut["grads"][name], grad, rtol=1e-5, atol=1e-7)


def test_sft_lowers_the_held_out_loss_and_logs_what_it_did(sft_run):
    rows = dict(keyed_rows(sft_run))
    assert sorted(step for step, kind in rows if kind == "eval") == [0, 10, 20, 30]
    assert rows[30, "eval"]["eval/loss"] < rows[0, "eval"]["eval/loss"] / 3
    assert rows[30, "train"]["loss"] < rows[1, "train"]["loss"] / 3
    # 16 rows of 2 response tokens per step: the digit and <|im_end|>.
    assert rows[1, "train"]["tokens"] == 32
    assert rows[30, "train"]["epoch"] == 30 * 16 / 24
    console = (sft_run / "console.txt").read_text()
    assert "done: trained to step 30" in console and "eval/loss" in console
    assert f"HF export:   {sft_run / 'hf'}" in console


def test_the_rl_run_loads_the_export_and_vllm_answers_as_the_sft_trainer(sft_run, tmp_path):
    """The SFT trainer's greedy completions of the held-out prompts (its last evaluation, the
    exported weights) equal the RL run's vLLM greedy completions of them at step 0."""
    sft_samples = json.loads((sft_run / "eval.jsonl").read_text().splitlines()[-1])["samples"]
    assert len(sft_samples) == 36
    assert sum(s["exact_match"] for s in sft_samples) >= 9  # it learned something
    assert all(s["token_ids"][-1] == IM_END for s in sft_samples)  # and to stop
    result = run_train(
        *("--job.config_file", "run_configs/arith_cpu.toml", "--job.dump_folder", str(tmp_path)),
        *("--model.hf_checkpoint", str(sft_run / "hf"), "--training.steps", "1"),
        *("--eval.log_samples", "18", "--checkpoint.export_hf_at_end", "false"),
        nproc=2,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    start = json.loads((tmp_path / "eval.jsonl").read_text().splitlines()[0])
    assert start["step"] == 0
    # Rank 0 evaluates the first half of the held-out set; its samples are those.
    rl_ids = [sample["token_ids"][0] for sample in start["samples"]]
    assert rl_ids == [s["token_ids"] for s in sft_samples[:18]]
    exact = sum(s["exact_match"] for s in sft_samples) / 36
    assert start["eval/accuracy"] >= exact  # math-verify also accepts what exact match does
