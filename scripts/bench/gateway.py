"""The agents' gateway against the in-process environment: the calculator task's episodes, the
same prompts and seeds, run by the `Calculator` environment and by the OpenAI-client agent
(torchtitan_rl/tasks/calculator_agent.py) through the gateway, on one engine.

    .venv/bin/python scripts/bench/gateway.py --checkpoint outputs/sft_tools_cpu/hf

The tool demo's run shape (16 prompts x 8 episodes per step over 2 ranks: 64 episodes, a call
then an answer, max_model_len 160): `--rounds` timed rounds each side after an untimed warm-up,
alternating. Prints one JSON line: `env_s` and `agent_s` (median seconds of a round's episodes),
`ratio` = agent / env (target <= 1.1), `same_tokens` (the two sides' ids, masks and rewards
equal), `turns` (requests per round) and `per_turn_overhead_ms`. `--sessions K --stream`
instead runs K concurrent streaming sessions of a chat agent (no tools) and reports `p50_ms`,
`p99_ms` per turn and `cross_talk` (sessions whose recorded ids are not their own samples).
`--profile` prints the agent side's cProfile.
"""

import argparse
import asyncio
import cProfile
import json
import pstats
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
        [s.token_ids, s.sampled_mask, float(r)]
        for group, rewards in zip(
            scored.completions.samples, scored.rewards_PN.tolist(), strict=True
        )
        for s, r in zip(group, rewards, strict=True)
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", default="outputs/sft_tools_cpu/hf")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()

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
        same = results["env"] == results["agent"]
        if not same:
            for i, (a, b) in enumerate(zip(results["env"], results["agent"], strict=True)):
                if a != b:
                    print(f"sample {i} differs: env {a}\nagent {b}", file=sys.stderr)
                    break
            break
    turns = sum(1 for s in results["agent"] for _ in [0]) * 0
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


if __name__ == "__main__":
    asyncio.set_event_loop_policy(None)
    main()
