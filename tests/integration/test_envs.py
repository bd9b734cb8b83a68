"""Multi-turn episodes on the real vLLM engine (token-exact), whole runs with a user
environment and hooks (bitwise on policy, both placements), and the shipped tool data.
With a scripted policy: tests/unit/test_envs.py.

    .venv/bin/python -m pytest tests/integration/test_envs.py
"""

import json

import pytest
import torch
from helpers import runs
from helpers.launch import HELPERS, REPO, TIMING, run_dist, run_script, run_train
from helpers.render import chatter_renderer

from torchtitan_rl.tasks.env import calc, parse_tool_calls

IM_END = 4


@pytest.fixture(scope="module")
def renderer():
    return chatter_renderer()


# Multi-turn episodes on the real vLLM engine.


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    out = tmp_path_factory.mktemp("episodes") / "episodes.json"
    run_dist("episodes_run.py", str(out), nproc=0)
    return json.loads(out.read_text())


def test_real_episodes_train_on_exactly_the_sampled_and_rendered_ids(real, renderer):
    result = real["episodes"]
    assert max(e["turns"] for e in result["episodes"]) >= 2
    calls = iter(result["calls"][1:])
    pending = {}
    first_call = result["calls"][0]
    # Replay the episodes from the recorded generate calls: turn 1 is the first call's samples
    # (n = 3 per prompt); each later call's prompts are earlier ids plus the rendered reply.
    for e, (sampled, logprobs, _) in zip(result["episodes"], first_call["samples"], strict=True):
        pending[id(e)] = (e, [(sampled, logprobs)])
    live = [e for e in result["episodes"] if e["turns"] > 1]
    turn = 1
    while live:
        call = next(calls)
        assert len(call["prompts"]) == len(live)
        for e, prompt, (sampled, logprobs, _) in zip(
            live, call["prompts"], call["samples"], strict=True
        ):
            turns = pending[id(e)][1]
            so_far = e["first_ids"] + e["token_ids"][: len(prompt) - len(e["first_ids"])]
            assert prompt == so_far  # the previous turn's exact ids, then the reply's
            turns.append((sampled, logprobs))
        turn += 1
        live = [e for e in live if e["turns"] > turn]
    for e, turns in pending.values():
        mask, ids, lps = e["sampled_mask"], e["token_ids"], e["logprobs"]
        sampled_ids = [t for t, m in zip(ids, mask, strict=True) if m]
        sampled_lps = [lp for lp, m in zip(lps, mask, strict=True) if m]
        assert sampled_ids == [t for s, _ in turns for t in s]
        assert sampled_lps == [lp for _, s in turns for lp in s]
        assert all(lp == 0.0 for lp, m in zip(lps, mask, strict=True) if not m)
        # Each environment segment is the rendered reply to the turn before it.
        messages = e["messages"]  # user, then (assistant, tool) per turn, the last assistant
        start = 0
        for t in range(e["turns"] - 1):
            end = start + len(turns[t][0])
            last = turns[t][0][-1]
            reply = renderer.reply_ids(
                messages[: 1 + 2 * t],
                [messages[2 + 2 * t]],
                None,
                stop_id=last if last in (IM_END, 1) else None,
            )
            assert ids[end : end + len(reply)] == reply and not any(mask[end : end + len(reply)])
            start = end + len(reply)
    # The trainer's rows: first prompt + the episode's ids; the loss on sampled ids only.
    for row, (mask_row, e) in enumerate(
        zip(result["loss_mask_BT"], result["episodes"], strict=True)
    ):
        length = len(e["first_ids"]) + len(e["token_ids"])
        assert result["tokens_BT"][row][:length] == e["first_ids"] + e["token_ids"]
        assert mask_row[:length] == [0.0] * len(e["first_ids"]) + [
            float(m) for m in e["sampled_mask"]
        ]


def test_real_episodes_stop_before_max_model_len(real):
    short = real["short"]["episodes"]
    assert max(e["turns"] for e in short) == 2  # a third turn cannot fit in 72
    assert all(e["finish_reason"] == "length" for e in short)
    assert all(len(e["first_ids"]) + len(e["token_ids"]) <= 72 for e in short)


# The whole loop: a user environment and user hooks from the config, 2 ranks, bitwise.


def chatter_run(placement: str, folder, *task: str, env=None) -> None:
    """A 3-step run of 8 prompts on 2 ranks, batch-invariant, whose episodes are `task`'s."""
    # The disaggregated trainer is 1 rank: no expert parallel there.
    moe = runs.MOE_MODEL if placement == "colocated" else runs.MOE_MODEL[:4]
    result = run_train(
        *moe,
        "--job.config_file",
        "run_configs/debug_cpu.toml",
        "--generator.placement",
        placement,
        "--batch_invariant",
        "true",
        "--training.steps",
        "3",
        "--training.prompts_per_step",
        "8",
        *task,
        *runs.CHATTER,
        "--metrics.rollout_log_interval",
        "2",
        "--job.dump_folder",
        str(folder),
        nproc=2,
        env={"PYTHONPATH": HELPERS, **(env or {})},
    )
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.fixture(scope="module")
def env_run(tmp_path_factory):
    """The colocated run of user_envs:Chatter, with user hooks: (its folder, its hooks' record)."""
    folder = tmp_path_factory.mktemp("env_run")
    record = folder / "hooks.json"
    env = ("--task.name", "env", "--task.env", "user_envs:Chatter")
    hooks = ("--job.hooks", "user_envs:RecordSteps")
    chatter_run("colocated", folder / "run", *env, *hooks, env={"HOOKS_RECORD": str(record)})
    return folder / "run", record


@pytest.mark.shares("env_run")
@pytest.mark.parametrize("placement", ["colocated", "disaggregated"])
def test_multi_turn_run_is_bitwise_on_policy_with_a_user_env_and_hooks(
    placement, tmp_path, request
):
    """The mixture-of-experts tiny Qwen3 (colocated: its experts split over the 2 ranks): each
    turn's routing, captured in the generator and merged over the episode, is the trainer's."""
    if placement == "colocated":
        folder, record = request.getfixturevalue("env_run")
    else:
        folder, record = tmp_path / "run", tmp_path / "hooks.json"
        env = ("--task.name", "env", "--task.env", "user_envs:Chatter")
        hooks = ("--job.hooks", "user_envs:RecordSteps")
        chatter_run(placement, folder, *env, *hooks, env={"HOOKS_RECORD": str(record)})
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [row["logprob_diff/max"] for row in rows] == [0.0] * 3
    assert [row["moe/routing_mismatch"] for row in rows] == [0.0] * 3
    # Every (token, layer) the generator ran but its last: first prompts ~50, turns ~6 tokens.
    assert all(row["moe/routing_compared"] > 8 * 4 * 2 * 50 for row in rows)
    assert all(row["env/turns"] > 1.5 for row in rows)
    assert json.loads(record.read_text()) == {"env": "user_envs:Chatter", "steps": [1, 2, 3]}
    logged = [json.loads(line) for line in (folder / "rollouts.jsonl").read_text().splitlines()]
    episode = max((s for row in logged for s in row["samples"]), key=lambda s: len(s["messages"]))
    assert [m["role"] for m in episode["messages"]][:4] == [
        "user",
        "assistant",
        "tool",
        "assistant",
    ]
    assert 0 in episode["sampled_mask"] and episode["logprob_diff"] == [0.0] * sum(
        episode["sampled_mask"]
    )
    assert torch.tensor(episode["generator_logprobs"]).le(0).all()


def test_an_openai_client_agent_through_the_gateway_samples_the_environments_tokens(
    env_run, tmp_path
):
    """user_envs:chatter_agent does what Chatter does, from the agent's side, through the
    gateway: the same run, row for row and token for token, bitwise on policy (batch-
    invariant), its mixture-of-experts routing replayed from what the gateway's requests
    routed (EP = 2)."""
    folder, _ = env_run
    agent = ("--task.name", "agent", "--task.agent", "user_envs:chatter_agent")
    chatter_run("colocated", tmp_path / "run", *agent, "--algorithm.router_replay", "true")
    expected, got = (
        [json.loads(line) for line in (f / "metrics.jsonl").read_text().splitlines()]
        for f in (folder, tmp_path / "run")
    )
    assert [row["logprob_diff/max"] for row in got] == [0.0] * 3
    assert [row["moe/routing_mismatch"] for row in got] == [0.0] * 3
    for row, mine in zip(expected, got, strict=True):
        for metric, value in row.items():
            if metric.startswith(TIMING) or metric.startswith("moe/replay"):
                continue
            assert mine.get(metric) == value, (row["step"], metric, mine.get(metric), value)
    samples = [
        [(s["token_ids"], s["sampled_mask"], s["reward"]) for s in json.loads(line)["samples"]]
        for f in (folder, tmp_path / "run")
        for line in (f / "rollouts.jsonl").read_text().splitlines()
    ]
    assert samples[: len(samples) // 2] == samples[len(samples) // 2 :]


# The calculator demo's data.


def test_the_shipped_tool_data_is_what_its_script_makes_and_its_calls_compute_the_answers(
    tmp_path,
):
    result = run_script("make_tool_data.py", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    shipped = REPO / "data" / "arith_tools"
    for name in ("train.jsonl", "sft.jsonl"):
        assert (tmp_path / name).read_bytes() == (shipped / name).read_bytes(), name
    assert (tmp_path / "test.parquet").read_bytes() == (shipped / "test.parquet").read_bytes()
    traces = [json.loads(line)["messages"] for line in (shipped / "sft.jsonl").open()]
    with_tool = [t for t in traces if len(t) == 4]
    assert len(with_tool) == len(traces) // 2
    for user, call, tool, answer in with_tool:
        (parsed,) = parse_tool_calls(call["content"])
        assert calc(**parsed.arguments) == tool["content"] == answer["content"]
        assert parsed.arguments["expression"] + "=" == user["content"]
    train = {json.loads(line)["prompt"] for line in (shipped / "train.jsonl").open()}
    assert len(train) == 512 and not train & {t[0]["content"] for t in traces[512:]}
