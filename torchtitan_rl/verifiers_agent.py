"""A `verifiers` environment as an agent server (task.agent_url): each episode the trainer
asks for runs as verifiers runs it (the environment's harness program in its runtime, its
model calls through verifiers' interception to the episode's gateway session) and answers the
reward verifiers scores. It runs in a venv of its own (./scripts/setup_verifiers.sh), since
verifiers 0.4 pins `openai` 2 and `mcp` 2.0 beside this project's `openai` 3.

    .venv-verifiers/bin/python -m torchtitan_rl.verifiers_agent --taskset ID \
        --dataset outputs/vf/tasks.jsonl --port 8100
    torchrun --nproc_per_node 2 -m torchtitan_rl.train ... --task.name agent \
        --task.dataset_path outputs/vf/tasks.jsonl --task.agent_url http://127.0.0.1:8100/
    .venv/bin/python -m pytest tests/integration/test_gateway.py -k agent_servers

The taskset's tasks are the run's prompts: the server writes them to --dataset, one row per
task in the taskset's order ({"prompt": the task's prompt text, "answer": ""}), and maps a
row back to its task by the row number the trainer sends. Imports nothing of torchtitan_rl,
torch or vLLM.
"""

import argparse
import asyncio
import itertools
import json
import os
import socket
import sys
from pathlib import Path

_keys = itertools.count()


def env_config(taskset: str, harness: str | None, runtime: str):
    """The single-agent environment config of `taskset`, played by `harness` (None: the
    taskset's default) in `runtime` (subprocess, docker, prime, ...)."""
    import verifiers.v1 as vf

    agent = {"runtime": {"type": runtime}}
    if harness is not None:
        agent["harness"] = {"id": harness}
    return vf.SingleAgentEnvConfig(taskset={"id": taskset}, agent=agent)


def build_env(config):
    """The environment of `config`, refused unless it is single-agent."""
    import verifiers.v1 as vf
    from verifiers.v1.utils.loaders import load_environment

    env = load_environment(config)
    taskset = config.taskset.id
    if not isinstance(env, vf.SingleAgentEnv):
        raise SystemExit(
            f"--taskset {taskset}: its environment {type(env).__name__} is not single-agent; "
            "the gateway trains one agent's turns per episode, so run a single-agent taskset"
        )
    return env


async def prepare(config) -> None:
    """Set up the harness program once (a `uv` script's environment, fetched the first time)
    before any episode, as each episode's setup would: episodes then only check it."""
    import verifiers.v1 as vf
    from verifiers.v1.runtimes import provision_runtime
    from verifiers.v1.utils.loaders import load_harness

    harness = load_harness(config.agent.harness or vf.default_agent_harness(config.taskset.id))
    async with provision_runtime(config.agent.runtime) as runtime:
        await harness.setup(runtime)


def write_rows(tasks: list, path: Path) -> None:
    """One dataset row per task: the prompt the run groups its episodes by, and no answer
    (verifiers scores the episode)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for index, task in enumerate(tasks):
            f.write(json.dumps({"prompt": _prompt(task, index), "answer": ""}) + "\n")


def _prompt(task, index: int) -> str:
    return task.data.prompt_text.strip() or task.data.name or f"verifiers task {index}"


def task_of(tasks: list, row: dict):
    """The task of a dataset row ({"prompt", "row": "file:number"}, tasks.agent.row_of)."""
    where = str(row.get("row", ""))
    number = where.rpartition(":")[2]
    if not number.isdigit() or not 1 <= int(number) <= len(tasks):
        raise ValueError(f"row {where!r} is not one of this taskset's {len(tasks)} rows")
    task = tasks[int(number) - 1]
    if row.get("prompt") != _prompt(task, int(number) - 1):
        raise ValueError(
            f"row {where} is not task {int(number) - 1} of this taskset: train on the rows "
            "this server wrote (task.dataset_path = its --dataset)"
        )
    return task


async def run_episode(env, task, base_url: str, api_key: str, model: str) -> float:
    """One episode of `task` against the gateway session at `base_url`; its reward."""
    import verifiers.v1 as vf

    # verifiers reads an endpoint's key from an environment variable; one per episode, since
    # each session has its own. The runtime keeps names holding API_KEY from the program.
    variable = f"TORCHTITAN_RL_SESSION_API_KEY_{next(_keys)}"
    os.environ[variable] = api_key
    try:
        client = vf.EvalClientConfig(base_url=base_url, api_key_var=variable)
        # Each episode its own interception: it keeps a client per endpoint until it closes.
        async with env.serving():
            episode = await env.run_episode(task, vf.ModelContext(model=model, client=client))
    finally:
        del os.environ[variable]
    if not episode.ok:
        errors = [e.message for e in episode.errors]
        errors += [e.message for trace in episode.traces for e in trace.errors]
        raise RuntimeError(f"the verifiers episode failed: {'; '.join(errors)[:500]}")
    return sum(trace.reward for trace in episode.traces)


def serve(env, tasks: list, sock: socket.socket) -> None:
    """POST / with {base_url, api_key, model, row}: {"reward": float}, or a 500 saying why."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def episode(request):
        body = await request.json()
        try:
            task = task_of(tasks, body["row"])
        except ValueError as e:
            return JSONResponse({"error": str(e)}, status_code=500)
        work = asyncio.ensure_future(
            run_episode(env, task, body["base_url"], body["api_key"], body["model"])
        )
        # A trainer that gave up on the episode (task.env_timeout_s, the run's end) hangs up:
        # the episode is cancelled, and verifiers stops its program.
        while not (await asyncio.wait({work}, timeout=0.5))[0]:
            if await request.is_disconnected():
                work.cancel()
                return JSONResponse({"error": "the trainer hung up"}, status_code=499)
        try:
            return JSONResponse({"reward": work.result()})
        except RuntimeError as e:
            return JSONResponse({"error": str(e)}, status_code=500)

    app = Starlette(routes=[Route("/", episode, methods=["POST"])])
    # On SIGTERM, episodes in flight get 10 s to end (the trainer gone, their requests fail
    # fast), then are cancelled: verifiers stops their programs either way.
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=10)
    uvicorn.Server(config).run(sockets=[sock])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--taskset", required=True, help="the verifiers taskset id")
    parser.add_argument("--harness", help="the harness id (default: the taskset's)")
    parser.add_argument("--runtime", default="subprocess", help="where the harness runs")
    parser.add_argument("--dataset", required=True, type=Path, help="the rows to write")
    parser.add_argument("--port", type=int, default=0, help="0: any free port")
    parser.add_argument("--port-file", type=Path, help="write the port here once listening")
    args = parser.parse_args(argv)
    if args.dataset.suffix != ".jsonl":
        parser.error(f"--dataset {args.dataset}: name a .jsonl file (the run's task.dataset_path)")
    # The harness programs are `uv` scripts: this venv's uv, found before any other.
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    try:
        config = env_config(args.taskset, args.harness, args.runtime)
        env = build_env(config)
        asyncio.run(prepare(config))
    except (ImportError, ValueError, TypeError, RuntimeError) as e:  # pydantic's are ValueError
        said = " ".join(str(e).split())[:600] or type(e).__name__
        raise SystemExit(f"verifiers_agent: --taskset {args.taskset}: {said}") from None
    tasks = list(env.taskset)
    write_rows(tasks, args.dataset)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # NODELAY
    sock.bind(("127.0.0.1", args.port))
    port = sock.getsockname()[1]
    print(f"verifiers_agent: {len(tasks)} tasks in {args.dataset}, on port {port}", flush=True)
    if args.port_file is not None:
        args.port_file.write_text(str(port))
    serve(env, tasks, sock)


if __name__ == "__main__":
    main()
