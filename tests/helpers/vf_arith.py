"""A `verifiers` taskset as its users write one (verifiers.v1: task data, a task with a
@vf.reward, a taskset that loads them), over the arithmetic rows; served to a run by
torchtitan_rl.verifiers_agent in .venv-verifiers (tests/integration/test_gateway.py). Its
reward is a function of the reply alone, so a test can recompute it from the logged tokens.
"""

import json
from pathlib import Path

import verifiers.v1 as vf

ROWS = Path(__file__).resolve().parents[2] / "data" / "arith" / "train.jsonl"


class ArithData(vf.TaskData):
    answer: str = ""


class ArithTask(vf.Task[ArithData]):
    @vf.reward(weight=1.0)
    async def length(self, trace: vf.Trace) -> float:
        return reward_of(trace.last_reply)


def reward_of(reply: str) -> float:
    """What a reply scores: tenths of its stripped length (the tiny policy seldom answers)."""
    return len(reply.strip()) / 10


class ArithTaskset(vf.Taskset[ArithTask, vf.TasksetConfig]):
    def load(self) -> list[ArithTask]:
        rows = [json.loads(line) for line in ROWS.read_text().splitlines()[:16]]
        return [ArithTask(ArithData(prompt=r["prompt"], answer=r["answer"])) for r in rows]


__all__ = ["ArithTaskset"]
