"""The agents' gateway against the in-process environment: the calculator task's episodes, the
same prompts and seeds, run by the `Calculator` environment and by the OpenAI-client agent
(torchtitan_rl/tasks/calculator_agent.py) through the gateway, on one engine.

    .venv/bin/python scripts/bench/gateway.py --checkpoint outputs/sft_tools_cpu/hf

The tool demo's run shape (16 prompts x 8 episodes per step over 2 ranks: 64 episodes, a call
then an answer, max_model_len 160): `--rounds` timed rounds each side after an untimed warm-up,
alternating. Prints one JSON line: `env_s` and `agent_s` (median seconds of a round's episodes),
`ratio` = agent / env, `same_tokens` (the two sides' ids, masks, finish reasons and rewards
equal in every round, the warm-up's included; a round where they differ stops the bench with an
`error:` line and the first differing sample), `turns` (requests per round) and
`per_turn_overhead_ms`. `--steps N` instead runs the demo's two RL runs (the step time ratio,
target <= 1.1; their metric rows compared in every trial, and an `error:` line naming the
trials where they differ); with `--chatter CHECKPOINT` a 3-turn chat on that checkpoint
instead (e.g. assets/debug_qwen3);
with `--verifiers` a `verifiers` environment served by torchtitan_rl.verifiers_agent
(tests/helpers/vf_arith.py, its `null` harness: one request an episode) against the same
episode by an in-process `openai` agent (user_envs:arith_agent), on assets/tiny_qwen3
(`in_process_step_s`, `verifiers_step_s`).
`torchrun --nproc_per_node 2 scripts/bench/gateway.py --sessions K` runs K concurrent streaming
sessions of a chat agent (no tools, 3 turns) over the ranks: `p50_ms`, `p99_ms` per turn,
`errors` and `cross_talk` (sessions whose recorded ids are not what their answers gave).
`--round_trip N --checkpoint assets/tiny_qwen3` (only its tokenizer is read) measures what a
turn costs the agent side beyond sampling: N sequential requests of the calculator agent's first
turn to a gateway whose sampler answers at once (no engine), the median milliseconds of a round
trip with the `openai` client (`openai_ms`), with raw `httpx` posting the same body
(`httpx_ms`), and of the gateway's own handling in process (`handling_ms`: its ASGI app called
directly, no client, no socket).
`--profile` prints the agent side's cProfile.
"""

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import shutil
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def episodes_of(name: str, checkpoint: str, max_model_len: int):
    from torchtitan_rl.config import JobConfig
    from torchtitan_rl.episodes import open_task

    config = JobConfig()
    config.model.name, config.model.flavor = "qwen3", "tiny"
    config.model.hf_checkpoint = checkpoint
    config.training.max_prompt_len = 32
    config.generator.max_model_len = max_model_len
    task = config.task
    task.dataset_path = str(REPO / "data/arith_tools/train.jsonl")
    task.max_turns = 2
    if name == "env":
        task.name, task.env = "env", "torchtitan_rl.tasks.env:Calculator"
    else:
        task.name, task.agent = "agent", "torchtitan_rl.tasks.calculator_agent:calculator"
    return open_task(config)


def summary(scored) -> list:
    return [
        [s.token_ids, s.sampled_mask, s.finish_reason, float(r)]
        for group, rewards in zip(
            scored.completions.samples, scored.rewards_PN.tolist(), strict=True
        )
        for s, r in zip(group, rewards, strict=True)
    ]


async def sessions(generator, count: int, turns: int) -> dict:
    """`count` concurrent streaming sessions of `turns` turns each (a chat agent, no tools) on
    this rank's engine, stepped as continuous placement steps it: per-turn latencies, errors,
    and the sessions whose recorded ids are not what their own responses gave."""
    import httpx
    import openai

    from torchtitan_rl.config import TaskSection
    from torchtitan_rl.episodes import _defaults
    from torchtitan_rl.gateway.protocol import load_parsers
    from torchtitan_rl.gateway.server import Gateway
    from torchtitan_rl.generator.stream import AsyncStream, RequestStream
    from torchtitan_rl.models import checkpoint_stop_ids
    from torchtitan_rl.tasks.render import build_renderer

    checkpoint = generator.config_checkpoint
    stream = AsyncStream(RequestStream(generator))

    async def drive():
        while True:
            if len(stream.stream):
                stream.step()
                await asyncio.sleep(0)
            else:
                await asyncio.sleep(0.0005)

    stepping = asyncio.ensure_future(drive())
    gateway = Gateway(stop_ids=set(checkpoint_stop_ids(checkpoint)), max_model_len=512)
    await gateway.start()
    task = TaskSection(name="agent", agent="x:y", dataset_path=str(REPO / "data"))
    renderer = build_renderer(task, checkpoint, max_prompt_len=64)
    parsers = load_parsers(renderer.tokenizer, "hermes", None, "task")
    sample = _defaults(lambda _, *a, **k: stream.sample(*a, **k), None, 32)

    async def one(i: int):
        url, opened = gateway.open(renderer, parsers, seed=i, order=i, sample=sample, max_turns=8)
        http = httpx.AsyncClient(timeout=None)
        client = openai.AsyncOpenAI(base_url=url, api_key=opened.key, http_client=http)
        messages, latencies, got = [{"role": "user", "content": f"{i}+{i}="}], [], []
        for _ in range(turns):
            began = time.perf_counter()
            chunks = [
                c
                async for c in await client.chat.completions.create(
                    model="policy",
                    messages=messages,
                    stream=True,
                    extra_body={"return_token_ids": True},
                )
            ]
            latencies.append(time.perf_counter() - began)
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            got.append([c.choices[0].model_extra.get("token_ids") for c in chunks][-1])
            messages += [
                {"role": "assistant", "content": content},
                {"role": "user", "content": "again"},
            ]
        segment = opened.session.segments[-1]
        sampled = [t for t, m in zip(segment.token_ids, segment.sampled_mask, strict=True) if m]
        await http.aclose()
        return latencies, sampled == [t for ids in got for t in ids] and len(
            opened.session.segments
        ) == 1

    results = await asyncio.gather(*(one(i) for i in range(count)), return_exceptions=True)
    stepping.cancel()
    errors = [repr(r) for r in results if isinstance(r, BaseException)]
    good = [r for r in results if not isinstance(r, BaseException)]
    return {
        "latencies": [x for latencies, _ in good for x in latencies],
        "cross_talk": sum(not mine for _, mine in good),
        "errors": errors,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", default="outputs/sft_tools_cpu/hf")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--steps", type=int, default=0)
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument(
        "--chatter",
        default=None,
        help="with --steps: instead of the demo, a 3-turn chat on the rows of data/arith "
        "(tests/helpers/user_envs.py: Chatter against chatter_agent) on this checkpoint, "
        "e.g. assets/debug_qwen3 (qwen3 debugmodel)",
    )
    parser.add_argument(
        "--verifiers",
        action="store_true",
        help="with --steps: a verifiers environment (.venv-verifiers) against an in-process "
        "agent doing the same episode",
    )
    parser.add_argument("--sessions", type=int, default=0)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument(
        "--round_trip",
        type=int,
        default=0,
        help="N timed requests of the gateway's HTTP path alone (an instant sampler, no engine)",
    )
    args = parser.parse_args()
    if args.round_trip:
        return asyncio.run(round_trip(args))
    if args.sessions:
        return concurrent(args)
    if args.steps:
        return steps(args)

    from torchtitan_rl import platform
    from torchtitan_rl.config import GeneratorSection, ModelSection
    from torchtitan_rl.generator.engine import LocalGenerator

    platform.init_distributed()
    generator = LocalGenerator(
        generator=GeneratorSection(max_model_len=160, num_kv_blocks=512),
        model=ModelSection(name="qwen3", flavor="tiny", hf_checkpoint=args.checkpoint),
        seed=0,
    )
    sides = {name: episodes_of(name, args.checkpoint, 160) for name in ("env", "agent")}
    prompts = sides["env"].task.every_prompt()
    times = {name: [] for name in sides}
    results = {}
    profile = cProfile.Profile() if args.profile else None
    for round_ in range(args.rounds + 1):
        batch = prompts[round_ * args.prompts : (round_ + 1) * args.prompts]
        for name, opened in sides.items():
            if profile is not None and name == "agent" and round_:
                profile.enable()
            generator.reset_prefix_cache()  # neither side reads KV the other computed
            began = time.perf_counter()
            scored = opened.episodes.run(generator, batch, seed=round_, n=args.n, max_tokens=80)
            spent = time.perf_counter() - began
            if profile is not None:
                profile.disable()
            results[name] = summary(scored)
            if round_:
                times[name].append(spent)
        if results["env"] != results["agent"]:
            # Loudly, in any round (the warm-up's included): a mismatch is the finding.
            for i, (a, b) in enumerate(zip(results["env"], results["agent"], strict=True)):
                if a != b:
                    print(f"sample {i} differs: env {a}\nagent {b}", file=sys.stderr)
                    break
            sys.exit(f"error: round {round_}: the agent's episodes differ from the env's")
        same = True
    env_s, agent_s = statistics.median(times["env"]), statistics.median(times["agent"])
    requests = sum(
        len([m for m in s.messages if m["role"] == "assistant"])
        for g in scored.completions.samples
        for s in g
    )
    turns = requests
    print(
        json.dumps(
            {
                "env_s": round(env_s, 3),
                "agent_s": round(agent_s, 3),
                "ratio": round(agent_s / env_s, 3),
                "same_tokens": same,
                "turns": turns,
                "per_turn_overhead_ms": round(1000 * (agent_s - env_s) / max(turns, 1), 3),
            }
        )
    )
    if profile is not None:
        pstats.Stats(profile, stream=sys.stderr).sort_stats("tottime").print_stats(45)
    platform.exit_process(0)


def steps(args) -> None:
    """--steps N: the demo's two RL runs (tools_rl_cpu.toml, tools_agent_rl_cpu.toml) on 2
    ranks, N steps each, alternating over --trials: the median step time of each (its first
    step left out), their ratio, and whether their metric rows are equal (timings and
    env/tool_error_rate aside: an environment counts its tools' failures, the gateway only
    the calls it could not parse)."""
    import subprocess
    import tempfile

    configs = {
        "env": ["--job.config_file", "run_configs/tools_rl_cpu.toml"],
        "agent": ["--job.config_file", "run_configs/tools_agent_rl_cpu.toml"],
    }
    checkpoint, env = args.checkpoint, None
    if args.chatter is not None:
        recipe = json.loads((Path(args.chatter) / "torchtitan.json").read_text())
        chatter = [
            *("--job.config_file", "run_configs/debug_cpu.toml", "--model.name", recipe["name"]),
            *("--model.flavor", recipe["flavor"], "--training.prompts_per_step", "16"),
            *("--task.dataset_path", "data/arith/train.jsonl", "--task.max_turns", "3"),
            *("--generator.sampling.max_tokens", "6", "--generator.sampling.stop", *"0123456789"),
        ]
        configs = {
            "env": [*chatter, "--task.name", "env", "--task.env", "user_envs:Chatter"],
            "agent": [*chatter, "--task.name", "agent", "--task.agent", "user_envs:chatter_agent"],
        }
        checkpoint, env = args.chatter, {**os.environ, "PYTHONPATH": str(REPO / "tests/helpers")}
    server = None
    if args.verifiers:
        served = Path(tempfile.mkdtemp())
        env = {**os.environ, "PYTHONPATH": f"{REPO / 'tests/helpers'}:{REPO}"}
        server = subprocess.Popen(
            [str(REPO / ".venv-verifiers/bin/python"), "-m", "torchtitan_rl.verifiers_agent"]
            + [
                "--taskset",
                "vf_arith",
                "--harness",
                "null",
                "--dataset",
                str(served / "rows.jsonl"),
            ]
            + ["--port-file", str(served / "port")],
            cwd=REPO,
            env=env,
        )
        while not (served / "port").is_file() or not (served / "port").read_text():
            assert server.poll() is None, "the verifiers server stopped"
            time.sleep(0.1)
        shared = [
            *("--job.config_file", "run_configs/debug_cpu.toml", "--task.name", "agent"),
            *(
                "--task.dataset_path",
                str(served / "rows.jsonl"),
                "--training.prompts_per_step",
                "4",
            ),
            # 32 episodes a step: each of verifiers' starts a program (~1.2 s of CPU), so
            # more would wait longer than task.env_timeout_s on 2 cores; no limit here.
            *("--generator.sampling.max_tokens", "6", "--task.env_timeout_s", "0"),
        ]
        configs = {
            "env": [*shared, "--task.agent", "user_envs:arith_agent"],
            "agent": [
                *shared,
                "--task.agent_url",
                f"http://127.0.0.1:{(served / 'port').read_text()}/",
            ],
        }
        checkpoint = "assets/tiny_qwen3"
    times, trials = {name: [] for name in configs}, []
    try:
        for _ in range(args.trials):
            rows = {}
            trials.append(rows)
            for name, flags in configs.items():
                with tempfile.TemporaryDirectory() as folder:
                    command = [
                        str(REPO / ".venv/bin/torchrun"),
                        "--standalone",
                        "--nproc_per_node",
                        "2",
                        "-m",
                        "torchtitan_rl.train",
                        *flags,
                        "--training.steps",
                        str(args.steps),
                        "--eval.dataset_path",
                        "None",
                        "--model.hf_checkpoint",
                        checkpoint,
                        "--job.dump_folder",
                        folder,
                    ]
                    done = subprocess.run(
                        command, cwd=REPO, capture_output=True, env=env, text=True
                    )
                    assert done.returncode == 0, done.stderr[-3000:]
                    lines = (Path(folder) / "metrics.jsonl").read_text().splitlines()
                    rows[name] = [json.loads(line) for line in lines]
                times[name] += [row["time/step_s"] for row in rows[name][1:]]
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=60)
            shutil.rmtree(served)
    skip = ("time/", "throughput/", "weight_sync/gb_per_s", "env/tool_error_rate")
    # Every trial's rows, not the last one's: the same figures, step for step, each time.
    differing = [
        t
        for t, rows in enumerate(trials)
        if not all(
            mine.get(key) == value
            for row, mine in zip(rows["env"], rows["agent"], strict=True)
            for key, value in row.items()
            if not key.startswith(skip)
        )
    ]
    if differing:
        sys.exit(f"error: trials {differing} of {args.trials}: the two sides' rows differ")
    same = True
    env_s, agent_s = statistics.median(times["env"]), statistics.median(times["agent"])
    labels = ("in_process", "verifiers") if args.verifiers else ("env", "agent")
    print(
        json.dumps(
            {
                f"{labels[0]}_step_s": round(env_s, 3),
                f"{labels[1]}_step_s": round(agent_s, 3),
                "step_ratio": round(agent_s / env_s, 3),
                "same_rows": same,
                "steps": args.steps,
                "trials": args.trials,
            }
        )
    )


async def round_trip(args) -> None:
    """--round_trip N: the calculator agent's first turn (its row's messages, tools=[calc])
    sent N times, each on a session of its own (as each episode opens one), to a gateway whose
    sampler answers at once with a tool call, so no engine time is in the figures. The three
    ways interleave, after 20 untimed requests each; the two clients over the socket keep one
    connection (the agent's client opens one per episode, then keeps it for its turns)."""
    from urllib.parse import urlsplit

    import httpx
    import openai

    from torchtitan_rl.episodes import _defaults
    from torchtitan_rl.gateway.server import MODEL
    from torchtitan_rl.tasks.calculator_agent import TOOLS
    from torchtitan_rl.types import Sample

    opened_task = episodes_of("agent", args.checkpoint, 160)
    source, gateway = opened_task.sources[""], opened_task.episodes.gateway
    prompt = opened_task.task.every_prompt()[0]
    tokenizer = source.renderer.tokenizer
    call = '<tool_call>\n{"name": "calc", "arguments": {"expression": "1+1"}}\n</tool_call>'
    ids = tokenizer.encode(call, add_special_tokens=False) + [min(gateway.stop_ids)]

    async def answer(order, prompt_ids, **options) -> Sample:
        return Sample(ids, [-0.5] * len(ids), "stop")

    sample = _defaults(answer, None, 80)
    messages = source.renderer.messages(prompt)
    body = {"model": MODEL, "messages": messages, "tools": TOOLS}
    encoded = json.dumps(body).encode()
    await gateway.start()
    http = httpx.AsyncClient(timeout=None)

    async def with_openai(url: str, key: str) -> float:
        client = openai.AsyncOpenAI(base_url=url, api_key=key, http_client=http, max_retries=0)
        began = time.perf_counter()
        response = await client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
        assert response.choices[0].message.tool_calls, response
        return time.perf_counter() - began

    async def with_httpx(url: str, key: str) -> float:
        began = time.perf_counter()
        response = await http.post(
            f"{url}/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}
        )
        assert response.json()["choices"][0]["message"]["tool_calls"], response.text
        return time.perf_counter() - began

    async def in_process(url: str, key: str) -> float:
        path = urlsplit(url).path + "/chat/completions"
        headers = [
            (b"content-type", b"application/json"),
            (b"authorization", f"Bearer {key}".encode()),
        ]
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": headers,
            "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", gateway.port),
        }
        # What the server hands the app: the body, then a client that stays connected.
        pending = [{"type": "http.request", "body": encoded}]
        began = time.perf_counter()
        connected = asyncio.get_running_loop().create_future()
        sent = []

        async def receive():
            return pending.pop() if pending else await connected

        async def send(message):
            sent.append(message)

        await gateway.app(scope, receive, send)
        spent = time.perf_counter() - began
        assert sent[0]["status"] == 200, sent
        return spent

    ways = {"openai_ms": with_openai, "httpx_ms": with_httpx, "handling_ms": in_process}
    times = {name: [] for name in ways}
    for i in range(20 + args.round_trip):
        for name, way in ways.items():
            url, opened = gateway.open(
                source.renderer, source.parsers, seed=i, order=0, sample=sample, max_turns=2
            )
            spent = await way(url, opened.key)
            gateway.close(opened)
            if i >= 20:
                times[name].append(spent)
    await http.aclose()
    figures = {name: round(1000 * statistics.median(t), 3) for name, t in times.items()}
    print(json.dumps({"requests": args.round_trip, **figures}))


def concurrent(args) -> None:
    """--sessions K over the ranks of torchrun (K / ranks each, one engine and gateway per
    rank): p50 / p99 of a turn's latency, errors, cross-talk."""
    import torch.distributed as dist

    from torchtitan_rl import platform
    from torchtitan_rl.config import GeneratorSection, ModelSection
    from torchtitan_rl.generator.engine import LocalGenerator

    platform.init_distributed()
    ranks = dist.get_world_size()
    generator = LocalGenerator(
        generator=GeneratorSection(max_model_len=512, num_kv_blocks=512),
        model=ModelSection(name="qwen3", flavor="tiny", hf_checkpoint=args.checkpoint),
        seed=0,
    )
    generator.config_checkpoint = args.checkpoint
    mine = asyncio.run(sessions(generator, args.sessions // ranks, args.turns))
    every = [None] * ranks
    dist.all_gather_object(every, mine)
    if dist.get_rank() == 0:
        latencies = sorted(x for r in every for x in r["latencies"])
        print(
            json.dumps(
                {
                    "sessions": args.sessions,
                    "ranks": ranks,
                    "turns": len(latencies),
                    "errors": sum(len(r["errors"]) for r in every),
                    "cross_talk": sum(r["cross_talk"] for r in every),
                    "p50_ms": round(1000 * latencies[len(latencies) // 2], 1),
                    "p99_ms": round(1000 * latencies[int(len(latencies) * 0.99)], 1),
                }
            )
        )
    platform.shutdown_distributed()
    platform.exit_process(0)


if __name__ == "__main__":
    asyncio.set_event_loop_policy(None)
    main()
