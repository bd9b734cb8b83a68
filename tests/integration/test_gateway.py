"""The agents' gateway on the real vLLM engine with the real `openai` client over HTTP
(tests/helpers/gateway_checks.py, run on tests/dist/stream_run.py's engine), and an agent
server outside the process driving a continuous run (task.agent_url). The scripted-policy
checks (tool calls, reasoning, forks, errors): tests/unit/test_gateway.py; an agent against
the environment, token for token: tests/integration/test_envs.py.

    .venv/bin/python -m pytest tests/integration/test_gateway.py
"""

import json
import subprocess
import sys
import time

import pytest
from helpers import runs
from helpers.launch import HELPERS, REPO, metric_rows, run_train


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


def test_an_agent_server_drives_a_continuous_run(tmp_path):
    """task.agent_url: a FastAPI agent server in its own process (as a container would run
    one), called once per episode, in continuous placement: sessions' turns may straddle
    weight updates, and the trainers would stop the run on a token older than the staleness
    bound (StalenessError)."""
    port_file = tmp_path / "port"
    server = subprocess.Popen(
        [sys.executable, f"{HELPERS}/user_envs.py", str(port_file)],
        env={"PYTHONPATH": f"{HELPERS}:{REPO}", "PATH": "/usr/bin:/bin"},
        stderr=subprocess.PIPE,
    )
    try:
        for _ in range(300):
            if port_file.is_file() and port_file.read_text():
                break
            assert server.poll() is None, server.stderr.read().decode()[-2000:]
            time.sleep(0.05)
        result = run_train(
            "--job.config_file",
            "run_configs/debug_cpu.toml",
            "--generator.placement",
            "continuous",
            "--algorithm.max_offpolicy_steps",
            "1",
            "--training.steps",
            "4",
            "--training.prompts_per_step",
            "4",
            "--task.name",
            "agent",
            "--task.agent_url",
            f"http://127.0.0.1:{port_file.read_text()}/",
            *runs.CHATTER,
            "--metrics.rollout_log_interval",
            "1",
            "--job.dump_folder",
            str(tmp_path / "run"),
            nproc=2,
        )
    finally:
        server.kill()
        server.wait(timeout=30)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metric_rows(tmp_path / "run")
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    assert all(row["env/turns"] > 1.5 for row in rows)
    assert any(row["reward/mean"] > 0 for row in rows)
    logged = [
        s
        for line in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()
        for s in json.loads(line)["samples"]
    ]
    assert any(
        [m["role"] for m in s["messages"]][:3] == ["user", "assistant", "tool"] for s in logged
    )
