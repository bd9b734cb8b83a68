"""A mixture run (run_configs/mixture_cpu.toml: a single-turn dataset source and a calculator
environment source, here 3:1) under torchrun with 2 ranks and the real vLLM engine: per-source
figures and logs; the dataset source scored by a function that raises on odd answers (counted,
scored 0) and a batched async one called once per source, rank and step; an exact resume
after a preemption, colocated and disaggregated (evaluations and reward errors included).

    .venv/bin/python -m pytest tests/integration/test_mixture.py

The draw itself, cursors and per-source sums on their own: tests/unit/test_mixture.py.
"""

import json
import signal

import pytest
from helpers.launch import (
    TINY,
    assert_resumed_as,
    metric_rows,
    preempt,
    run_train,
)

from torchtitan_rl.config import parse_args
from torchtitan_rl.episodes import open_task

# Random tiny weights (no SFT export needed), 4 steps of 8 prompts x 4 samples, evaluated
# after steps 2 and 4; the minmax source scored by two functions of test_faults' kind.
RAISES, BATCHED = "raises_on_odd", "async_batch_starts_with_answer"
TINY_MOE = "assets/tiny_moe_qwen3"
FLAGS = (
    *("--job.config_file", "run_configs/mixture_cpu.toml", "--model.hf_checkpoint", TINY),
    *("--training.steps", "4", "--training.prompts_per_step", "8"),
    *("--generator.sampling.n", "4", "--generator.sampling.max_tokens", "16"),
    *("--eval.interval", "2", "--eval.at_start", "false", "--metrics.rollout_log_interval", "1"),
    *("--checkpoint.enable", "--checkpoint.interval", "4"),
    *("--task.sources.minmax.weight", "3", "--task.sources.minmax.rewards"),
    *(f"helpers.user_rewards:{RAISES}", "1", f"helpers.user_rewards:{BATCHED}", "1"),
    # The tool episodes learn from a distill teacher alone, larger than the student (the
    # mixture-of-experts tiny Qwen3, sharded over both ranks); minmax from its rewards alone.
    *("--distill.teacher_checkpoint", TINY_MOE, "--distill.teacher_flavor", "tiny_moe"),
    *("--task.sources.minmax.learn_from", "reward", "--task.sources.tools.learn_from", "teacher"),
)


def expected_calls(rank: int, ranks: int = 2) -> list[int]:
    """The batch sizes of the batched reward's calls on `rank`, in order: one per evaluation
    and step whose shard holds minmax prompts, of all of that shard's minmax samples."""
    config = parse_args(list(FLAGS))
    opened = open_task(config)
    n, prompts_per_step = config.generator.sampling.n, config.training.prompts_per_step

    def eval_call() -> list[int]:
        held_out = opened.eval_prompts
        shard = held_out[rank * len(held_out) // ranks : (rank + 1) * len(held_out) // ranks]
        count = sum(p.source == "minmax" for p in shard)
        return [count] if count else []

    calls = []
    for step in range(1, config.training.steps + 1):
        share = prompts_per_step // ranks
        shard = opened.task.prompts(step, prompts_per_step)[rank * share : (rank + 1) * share]
        count = sum(p.source == "minmax" for p in shard)
        calls += [count * n] if count else []
        if step % 2 == 0:
            calls += eval_call()
    return calls


def test_a_mixture_run_logs_each_source_and_resumes_exactly(tmp_path, repo_cwd):
    out = tmp_path / "run"
    calls = tmp_path / "calls"
    result = run_train(
        *FLAGS,
        "--job.dump_folder",
        str(out),
        nproc=2,
        env={"TORCHTITAN_RL_CALLS_TO": str(calls)},
    )
    assert result.returncode == 0, result.stderr[-3000:]

    # Every step's figures, overall and for each source it drew prompts from.
    rows = metric_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    mixture = open_task(parse_args(list(FLAGS))).task
    for row in rows:
        drawn = {p.source for p in mixture.prompts(row["step"], 8)}
        for source in ("minmax", "tools"):
            assert (f"reward/mean/{source}" in row) == (source in drawn)
        for source in drawn:
            assert 0.0 <= row[f"reward/mean/{source}"] <= 2.0
            assert row[f"response_length/mean/{source}"] > 0
        # A function's mean is over its own source's samples: they sum to that source's mean.
        assert 0.0 <= row[f"reward/{RAISES}"] <= 0.5 and 0.0 <= row[f"reward/{BATCHED}"] <= 1
        assert row["reward/mean/minmax"] == pytest.approx(
            row[f"reward/{RAISES}"] + row[f"reward/{BATCHED}"]
        )
    # Every step draws odd answers, whose reward raises: counted (cumulatively), scored 0.
    errors = [row["reward/errors"] for row in rows]
    assert 0 < errors[0] < errors[1] < errors[2] < errors[3]
    evals = metric_rows(out, "eval")
    assert [r["eval/policy_version"] for r in evals] == [2, 4]
    for row in evals:
        for key in ("eval/accuracy/", "eval/pass@1/", "eval/response_length/"):
            assert {f"{key}minmax", f"{key}tools"} <= row.keys()
        assert row["eval/prompts"] == 36 + 64  # both eval sets, each read with its own keys

    # One call of the batched function per rank and step (or evaluation) with minmax prompts.
    for rank in (0, 1):
        logged = [int(n) for n in (tmp_path / f"calls.rank{rank}").read_text().split()]
        assert logged == expected_calls(rank), rank

    # The logs name each sample's source.
    logged = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert {s["source"] for entry in logged for s in entry["samples"]} <= {"minmax", "tools"}
    samples = [
        json.loads(line)["samples"] for line in (out / "eval.jsonl").read_text().splitlines()
    ]
    # Each rank logs its shard's first rows: rank 0's are minmax rows, rank 1's tools rows.
    assert {s["source"] for group in samples for s in group} == {"minmax", "tools"}

    assert_the_teacher_scored_the_tool_episodes_as_transformers_does(out, rows)

    # Preempted in step 3 (or after step 2; no checkpoint due), relaunched: the same rows and
    # weights, and the same count of reward errors (every rank's, carried on by rank 0). The
    # signal once went after step 3 and, with step 4 done first, left nothing to compare.
    stopped = tmp_path / "stopped"
    resumed_from = preempt(FLAGS, stopped, 2, signal.SIGTERM, rank=None)
    assert resumed_from in (2, 3), resumed_from
    result = run_train(*FLAGS, "--job.dump_folder", str(stopped), nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed from {stopped / 'checkpoints' / f'step-{resumed_from}'}" in result.stdout
    assert_resumed_as(out, stopped, resumed_from, exact=False)


def assert_the_teacher_scored_the_tool_episodes_as_transformers_does(out, rows) -> None:
    """Only the source that learns from the teacher has teacher figures; the logged teacher
    logprobs of its episodes are HF transformers' Qwen3-MoE forward of the teacher checkpoint
    on the same tokens, within 1e-5 (fp32), at the model's own tokens and 0 at any tool's (the
    random tiny model seldom calls the tool: tests/integration/test_envs.py has episodes that
    do, and the loss mask the teacher's scores follow)."""
    import torch
    from transformers import AutoModelForCausalLM

    drew_tools = False
    for row in rows:
        assert "distill/reverse_kl/minmax" not in row
        if "reward/mean/tools" in row:
            drew_tools = True
            assert row["distill/reverse_kl/tools"] == row["distill/reverse_kl"] != 0.0
            assert row["distill/teacher_logprob"] < 0
    assert drew_tools
    teacher = AutoModelForCausalLM.from_pretrained(TINY_MOE, torch_dtype=torch.float32)
    logged = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    samples = [s for entry in logged for s in entry["samples"]]
    assert all("teacher_logprobs" not in s for s in samples if s["source"] == "minmax")
    episodes = [s for s in samples if s["source"] == "tools"]
    assert episodes
    for sample in episodes:
        prompt, tokens = sample["prompt_token_ids"], sample["token_ids"]
        with torch.no_grad():
            logits_TV = teacher(torch.tensor([prompt + tokens])).logits[0]
        # Token t of the sample is predicted at position len(prompt) + t - 1.
        predicted_TV = logits_TV[len(prompt) - 1 : -1].log_softmax(dim=-1)
        expected_T = predicted_TV.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        mask_T = torch.tensor(sample["sampled_mask"], dtype=torch.float32)
        logged_T = torch.tensor(sample["teacher_logprobs"])
        torch.testing.assert_close(logged_T, expected_T * mask_T, atol=1e-5, rtol=0)


def test_a_disaggregated_mixture_run_resumes_with_its_evaluations_and_reward_errors(tmp_path):
    """The mixture on a trainer rank and a generator rank, evaluated after steps 2 and 4 (each
    evaluation sent with the next step's rollout), preempted after step 2 or 3: the
    resumed run logs the uninterrupted run's rows, among them the evaluation of its restored
    version (which the stopped run's generator made but its trainers never took) and the
    count of reward errors (the generator rank's own, carried on)."""
    flags = (*FLAGS, "--generator.placement", "disaggregated")
    reference = tmp_path / "run"
    result = run_train(*flags, "--job.dump_folder", str(reference), nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [r["eval/policy_version"] for r in metric_rows(reference, "eval")] == [2, 4]
    assert 0 < metric_rows(reference)[-1]["reward/errors"]
    stopped = tmp_path / "stopped"
    # The generator rank runs a rollout ahead: the stop lands a step after the signal's.
    resumed_from = preempt(flags, stopped, 1, signal.SIGTERM, rank=None)
    assert resumed_from in (2, 3), resumed_from
    result = run_train(*flags, "--job.dump_folder", str(stopped), nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_resumed_as(reference, stopped, resumed_from, exact=False)
