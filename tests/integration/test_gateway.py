"""The agents' gateway on the real vLLM engine with the real `openai` client over HTTP
(tests/helpers/gateway_checks.py, run on tests/dist/stream_run.py's engine), and an agent
server outside the process driving a continuous run (task.agent_url). The scripted-policy
checks (tool calls, reasoning, forks, errors): tests/unit/test_gateway.py; an agent against
the environment, token for token: tests/integration/test_envs.py.

    .venv/bin/python -m pytest tests/integration/test_gateway.py
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import runs
from helpers.launch import DEBUG_TOML, HELPERS, REPO, metric_rows, run_train, write_toml


@pytest.fixture(scope="module")
def real(stream_world):
    return stream_world["gateway"]


def test_recorded_ids_are_the_engines_sampled_ids_and_usage_counts_them(real):
    turns = real["turns"]
    # The gateway's turn is the engine's own sample of that prompt with the session's seed.
    assert turns["first_ids"] == turns["direct_ids"]
    assert turns["first_logprobs"] == pytest.approx(turns["direct_logprobs"], abs=1e-6)
    assert turns["second_ids"] == turns["direct2_ids"]
    assert turns["recorded_first"] == turns["first_prompt"]
    usage = turns["first_usage"]
    assert usage["prompt_tokens"] == len(turns["first_prompt"])
    assert usage["completion_tokens"] == len(turns["first_ids"]) == 8
    assert turns["content"] == turns["decoded"]
    # Turn 2's prompt: turn 1's prompt and sampled ids, then the tool reply rendered alone.
    sampled = turns["first_prompt"] + turns["first_ids"]
    assert turns["second_prompt"][: len(sampled)] == sampled
    delta = len(turns["second_prompt"]) - len(sampled)
    assert (
        turns["recorded_ids"]
        == turns["second_prompt"][len(turns["first_prompt"]) :] + (turns["second_ids"])
    )
    assert turns["recorded_mask"] == [1] * 8 + [0] * delta + [1] * len(turns["second_ids"])


def test_a_streamed_turn_is_the_non_streamed_one(real):
    stream, turns = real["stream"], real["turns"]
    assert stream["token_ids"] == turns["first_ids"]
    assert stream["content"] == turns["content"]
    assert stream["usage"] == turns["first_usage"]
    assert stream["chunks"] > 3  # the text came as it was sampled, not in one piece


def test_concurrent_streaming_sessions_each_record_their_own_ids(real):
    assert real["concurrent"]["mine"] == [True] * 32


def test_a_disconnect_aborts_and_a_version_bump_tags_the_tokens_after_it(real):
    assert real["disconnect"] == {
        "in_flight_before": 1,
        "in_flight_after": 0,
        "engine_unfinished": False,
    }
    versions = real["versions"]  # from the version at the turn's start
    assert versions[0] == 0 and versions[-1] == 1 and sorted(versions) == versions


def test_a_prompt_over_max_model_len_is_a_400_naming_the_field(real):
    status, message = real["too_long"]
    assert status == 400 and "generator.max_model_len = 256" in message


def test_agent_servers_drive_a_continuous_run(tmp_path):
    """task.agent_url, two agent servers in their own processes (as containers would run
    them), called once per episode, the two sources of one mixture in continuous placement:
    sessions' turns may straddle weight updates, and the trainers would stop the run on a
    token older than the staleness bound (StalenessError).

    - chatter: a FastAPI server driving `chatter_agent` (3 turns with tool replies);
    - vf: a `verifiers` environment (tests/helpers/vf_arith.py) served by
      torchtitan_rl.verifiers_agent from .venv-verifiers, its episodes played by verifiers'
      own `null` harness program through verifiers' interception, rewarded by verifiers."""
    vf_python = REPO / ".venv-verifiers" / "bin" / "python"
    assert vf_python.is_file(), "run ./scripts/setup_verifiers.sh (./scripts/test.sh does)"
    tasks = tmp_path / "vf_tasks.jsonl"
    servers = {
        "chatter": [sys.executable, f"{HELPERS}/user_envs.py"],
        "vf": [
            *(str(vf_python), "-m", "torchtitan_rl.verifiers_agent", "--taskset", "vf_arith"),
            *("--harness", "null", "--dataset", str(tasks), "--port-file"),
        ],
    }
    running, urls = {}, {}
    try:
        for name, command in servers.items():  # both start at once
            running[name] = subprocess.Popen(
                [*command, str(tmp_path / f"{name}.port")],
                env={**os.environ, "PYTHONPATH": f"{HELPERS}:{REPO}"},
                stderr=subprocess.PIPE,
            )
        for name, server in running.items():
            port_file = tmp_path / f"{name}.port"
            for _ in range(600):
                if port_file.is_file() and port_file.read_text():
                    break
                assert server.poll() is None, server.stderr.read().decode()[-2000:]
                time.sleep(0.05)
            urls[name] = f"http://127.0.0.1:{port_file.read_text()}/"
        config = write_toml(
            tmp_path,
            Path(DEBUG_TOML).read_text()
            + f"""
[task.sources.chatter]
name = "agent"
weight = 10
agent_url = "{urls["chatter"]}"
dataset_path = "data/arith/train.jsonl"
max_turns = 3

[task.sources.vf]
name = "agent"
weight = 1
agent_url = "{urls["vf"]}"
dataset_path = "{tasks}"
""",
        )
        result = run_train(
            "--job.config_file",
            config,
            "--generator.placement",
            "continuous",
            "--algorithm.max_offpolicy_steps",
            "1",
            # The admitted order: each step trains the prompts the mixture drew for it (vf
            # at step 1), however long verifiers' programs take to start.
            "--generator.batch_order",
            "admission",
            "--training.steps",
            "4",
            "--training.prompts_per_step",
            "4",
            *runs.CHATTER[4:],  # its sampling; the sources hold its rows and turns
            "--metrics.rollout_log_interval",
            "1",
            "--job.dump_folder",
            str(tmp_path / "run"),
            nproc=2,
        )
    finally:
        for server in running.values():
            # SIGTERM: the verifiers server stops its episodes' programs before it exits.
            server.terminate() if server.args[0] == str(vf_python) else server.kill()
            server.wait(timeout=30)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metric_rows(tmp_path / "run")
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    assert any(row["reward/mean"] > 0 for row in rows)
    for row in rows:
        # The chatter episodes' mean turns: a step's 4 groups are of one size, and the vf group
        # (at most one a step here) takes one turn an episode (no errors: none scored 0 by it).
        vf = "reward/mean/vf" in row
        assert row["reward/errors"] == 0 and (4 * row["env/turns"] - vf) / (4 - vf) > 1.5, row
    logged = [
        s
        for line in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()
        for s in json.loads(line)["samples"]
    ]
    chatter = [s for s in logged if s["source"] == "chatter"]
    assert any(
        [m["role"] for m in s["messages"]][:3] == ["user", "assistant", "tool"] for s in chatter
    )
    # verifiers' harness asked once with the task's prompt; the reward is the one verifiers
    # scored for the reply the gateway recorded (vf_arith.reward_of).
    prompts = [json.loads(line)["prompt"] for line in tasks.read_text().splitlines()]
    vf = [s for s in logged if s["source"] == "vf"]
    assert vf, "the mixture drew no verifiers prompt"
    for sample in vf:
        user, reply = sample["messages"]
        assert user == {"role": "user", "content": user["content"]} and user["content"] in prompts
        assert reply["role"] == "assistant" and sample["sampled_mask"] == [1] * len(
            sample["token_ids"]
        )
        assert sample["reward"] == pytest.approx(len(reply["content"].strip()) / 10)
