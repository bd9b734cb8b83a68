"""Mixtures of sources (task.sources): the draw by weight, each source's cursor, its rewards,
and the per-source figures of training and evaluation.

    .venv/bin/python -m pytest tests/unit/test_mixture.py

A real mixture run under torchrun, resumed exactly: tests/integration/test_mixture.py.
"""

import asyncio
import importlib.util
import json
import math

import pytest
import torch
from helpers.launch import TINY, write_toml

from torchtitan_rl import platform
from torchtitan_rl.config import parse_args, to_toml
from torchtitan_rl.episodes import open_task
from torchtitan_rl.learner import rollout_metrics
from torchtitan_rl.tasks.dataset import DatasetKeys, DatasetTask
from torchtitan_rl.tasks.mixture import Mixture
from torchtitan_rl.tasks.rewards import load_rewards
from torchtitan_rl.tasks.toy import EchoDigitsTask, ReverseDigitsTask
from torchtitan_rl.types import Completions, EvalShard, Prompt, Rollouts, Sample

pytestmark = pytest.mark.usefixtures("repo_cwd")

ARITH = "data/arith/train.jsonl"


def mixture(weights: dict[str, float], seed: int = 0) -> Mixture:
    tasks = {
        "echo": EchoDigitsTask(num_digits=2, seed=seed),
        "reverse": ReverseDigitsTask(num_digits=2, seed=seed),
        "arith": DatasetTask(ARITH, DatasetKeys(), seed=seed),
    }
    return Mixture({name: tasks[name] for name in weights}, weights, seed=seed)


def test_each_step_draws_its_sources_by_weight_seeded_by_step():
    mix = mixture({"echo": 3.0, "reverse": 1.0})
    drawn = [p.source for step in range(1, 401) for p in mix.prompts(step, 16)]
    share = drawn.count("echo") / len(drawn)
    # 6,400 draws of p = 0.75: the standard error is 0.0054; 4 of them is 0.022.
    assert abs(share - 0.75) < 0.022, share
    # Steps differ, and both sources appear within a step.
    assert len({tuple(mix.draw(step, 16)) for step in range(1, 50)}) > 40
    # A fresh mixture (a resumed run, another rank) draws the same prompts at any step.
    again = mixture({"echo": 3.0, "reverse": 1.0})
    assert again.prompts(250, 16) == mix.prompts(250, 16)
    assert again.prompts(7, 16, round=1) == mix.prompts(7, 16, round=1)
    assert mix.prompts(7, 16, round=1) != mix.prompts(7, 16)
    # Another seed, another draw; prompts say what they are.
    assert mixture({"echo": 3.0, "reverse": 1.0}, seed=1).draw(1, 16) != mix.draw(1, 16)
    for prompt in mix.prompts(3, 16):
        verb = "echo" if prompt.source == "echo" else "reverse"
        assert prompt.text.startswith(verb)


def test_a_source_walks_its_own_rows_from_a_cursor_without_gaps():
    """A dataset source reads its rows in the order it would alone, one epoch covering every
    row once, however the draws interleave it with other sources."""
    mix = mixture({"arith": 1.0, "echo": 2.0})
    alone = DatasetTask(ARITH, DatasetKeys(), seed=0)
    rows = [p for step in range(1, 60) for p in mix.prompts(step, 8) if p.source == "arith"]
    assert len(rows) > 144  # more than an epoch
    assert [(p.text, p.answer) for p in rows] == [
        (p.text, p.answer) for p in alone.rows(0, len(rows))
    ]
    assert len({p.row for p in rows[:144]}) == 144
    assert mix.cursor(60, 8)[0] == len(rows)


def test_open_task_gives_each_source_its_renderer_rewards_and_eval_rows(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend("tests/helpers")
    path = write_toml(
        tmp_path,
        f"""
[task.sources.plain]
name = "dataset"
dataset_path = "{ARITH}"
eval_dataset_path = "data/arith/test.parquet"
chat_template = false
weight = 2

[task.sources.chat]
name = "dataset"
dataset_path = "{ARITH}"
system_prompt = "Answer with a number."

[task.sources.chat.rewards]
"user_rewards:async_batch_starts_with_answer" = 1.0
"user_rewards:shorter_is_better" = 0.5
""",
    )
    config = parse_args(
        [
            "--job.config_file",
            path,
            "--model.hf_checkpoint",
            TINY,
            "--task.sources.chat.weight",
            "3",
        ]
    )
    assert config.task.sources["chat"].weight == 3.0
    # The written config reads back as the same config (sources and their tables included).
    assert parse_args(["--job.config_file", write_toml(tmp_path, to_toml(config))]) == config
    opened = open_task(config)
    assert isinstance(opened.task, Mixture) and opened.task.weights_S == [2.0, 3.0]
    plain, chat = Prompt("max(1,2)=", "2", source="plain"), Prompt("max(1,2)=", "2", source="chat")
    assert opened.renderer_of(plain).text(plain) == "max(1,2)="
    assert "Answer with a number." in opened.renderer_of(chat).text(chat)
    # Only the source with an eval set is evaluated, its rows tagged with its name.
    assert {p.source for p in opened.eval_prompts} == {"plain"} and len(opened.eval_prompts) == 36

    import user_rewards

    user_rewards.BATCH_CALLS.clear()
    prompts = [plain, chat, plain, chat, chat]
    total, parts = asyncio.run(opened.scorer.score(prompts, ["2", "2", "1", "2x", "x"]))
    # The chat source's batched function: one call with its three completions.
    assert user_rewards.BATCH_CALLS == [3]
    # plain: the task's math reward; chat: 1.0 * starts_with + 0.5 * -len / 10.
    assert total == pytest.approx([1.0, 0.95, 0.0, 0.9, -0.05])
    nan = math.nan
    assert parts["shorter_is_better"][1::2] == pytest.approx([-0.1, -0.2])
    assert math.isnan(parts["shorter_is_better"][0]) and math.isnan(parts["shorter_is_better"][2])
    assert parts["async_batch_starts_with_answer"][3:] == [1.0, 0.0]
    assert nan not in total


def test_two_sources_with_different_functions_of_one_name_are_refused(tmp_path):
    path = write_toml(
        tmp_path,
        f"""
[task.sources.a]
name = "dataset"
dataset_path = "{ARITH}"
rewards = {{"math:sqrt" = 1.0}}

[task.sources.b]
name = "dataset"
dataset_path = "{ARITH}"
rewards = {{"cmath:sqrt" = 1.0}}
""",
    )
    config = parse_args(["--job.config_file", path, "--model.hf_checkpoint", TINY])
    with pytest.raises(Exception, match="two different functions called 'sqrt'"):
        open_task(config)
    assert [r.name for r in load_rewards(None, {"math:sqrt": 1.0}, "task.sources.a")] == ["sqrt"]


def _rollouts(sources: list[str], rewards: list[float], lengths: list[int]) -> Rollouts:
    """One sample per prompt of `sources[i]`, with that reward and completion length."""
    samples = [[Sample(list(range(n)), [0.0] * n, "stop")] for n in lengths]
    parts = torch.tensor(
        [[r] if s == "a" else [math.nan] for s, r in zip(sources, rewards, strict=True)]
    )
    return Rollouts(
        prompts=[Prompt("p", "1", source=s) for s in sources],
        completions=Completions([[1]] * len(sources), samples),
        rewards_PN=torch.tensor([[r] for r in rewards]),
        reward_parts_PN={"fn_of_a": parts},
    )


def test_rollout_and_eval_figures_per_source(tmp_path):
    platform.patch_torchtitan()
    platform.init_distributed()  # a world of one: the figures' all-reduce
    path = write_toml(
        tmp_path,
        f'[task.sources.a]\nname = "dataset"\ndataset_path = "{ARITH}"\n'
        f'[task.sources.b]\nname = "dataset"\ndataset_path = "{ARITH}"\n'
        f'[task.sources.c]\nname = "dataset"\ndataset_path = "{ARITH}"\n',
    )
    config = parse_args(["--job.config_file", path, "--model.hf_checkpoint", TINY])
    rollouts = _rollouts(["a", "b", "a", "b"], [1.0, 0.0, 0.5, 0.25], [2, 4, 6, 8])
    figures = rollout_metrics(config, rollouts, errors=0)
    assert figures["reward/mean"] == pytest.approx(0.4375)
    assert figures["reward/mean/a"] == 0.75 and figures["reward/mean/b"] == 0.125
    assert figures["response_length/mean/a"] == 4 and figures["response_length/mean/b"] == 6
    # A function of source a is averaged over a's samples; c drew nothing this step.
    assert figures["reward/fn_of_a"] == 0.75
    assert not [k for k in figures if k.endswith("/c")]

    shard = EvalShard(
        3,
        {
            **dict(prompts=3, samples=6, correct=3, reward=3, tokens=30, truncated=0),
            **{"tool_calls": 0, "pass@1": 1.5, "pass@2": 2.0},
            **{"prompts/a": 1, "samples/a": 2, "correct/a": 2, "tokens/a": 4},
            **{"pass@1/a": 1.0, "pass@2/a": 1.0},
            **{"prompts/b": 2, "samples/b": 4, "correct/b": 1, "tokens/b": 26},
            **{"pass@1/b": 0.5, "pass@2/b": 1.0},
        },
    )
    figures = shard.metrics()
    assert figures["eval/accuracy"] == 0.5 and figures["eval/pass@2"] == pytest.approx(2 / 3)
    assert figures["eval/accuracy/a"] == 1.0 and figures["eval/accuracy/b"] == 0.25
    assert figures["eval/pass@1/b"] == 0.25 and figures["eval/pass@2/b"] == 0.5
    assert figures["eval/response_length/b"] == 6.5


def test_help_lists_each_source_s_flags_with_their_docstrings(capsys):
    with pytest.raises(SystemExit) as exit:
        parse_args(["--job.config_file", "run_configs/mixture_cpu.toml", "--help"])
    assert exit.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for source in ("minmax", "tools"):
        assert f"--task.sources.{source}.weight FLOAT" in text
        assert f"--task.sources.{source}.eval_dataset_path" in text
    assert "The source's share of each step's prompts" in text


def test_plot_metrics_draws_a_curve_per_source(tmp_path):
    spec = importlib.util.spec_from_file_location("plot_metrics", "scripts/plot_metrics.py")
    plot_metrics = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot_metrics)
    rows = [
        {"step": 1, "reward/mean": 0.5, "reward/mean/a": 0.25, "reward/mean/b": 0.75},
        {"step": 2, "reward/mean": 0.5, "reward/mean/a": 0.5},  # b drew no prompt
        {"step": 2, "eval/accuracy": 0.5, "eval/accuracy/a": 0.0, "eval/accuracy/b": 1.0},
    ]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(row) + "\n" for row in rows))
    drawn = plot_metrics.plot(metrics, tmp_path / "curves.png")
    assert drawn == [
        "reward/mean",
        "reward/mean/a",
        "reward/mean/b",
        "eval/accuracy",
        "eval/accuracy/a",
        "eval/accuracy/b",
    ]
    assert (tmp_path / "curves.png").stat().st_size > 10_000
