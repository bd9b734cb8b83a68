"""Reward functions that tests name as task.reward_fn (with tests/helpers on PYTHONPATH)."""

import asyncio
import os
import time

from torchtitan_rl.tasks.rewards import batched

_calls = 0


def starts_with_answer(prompt: str, completion: str, answer: str) -> float:
    return 1.0 if completion.startswith(answer) else 0.0


def raises_on_odd(prompt: str, completion: str, answer: str) -> float:
    if int(answer) % 2:
        raise ValueError("odd answers are not scored")
    return 1.0 if completion.startswith(answer) else 0.0


def hangs_on_odd(prompt: str, completion: str, answer: str) -> float:
    if int(answer) % 2:
        time.sleep(60)
    return 1.0 if completion.startswith(answer) else 0.0


def nan_from_step_3(prompt: str, completion: str, answer: str) -> float:
    """The echo reward for the demo config's first 2 steps (128 calls per rank and step on 2
    ranks), then NaN."""
    global _calls
    _calls += 1
    return float("nan") if _calls > 256 else (1.0 if completion.startswith(answer) else 0.0)


async def async_starts_with_answer(prompt: str, completion: str, answer: str) -> float:
    """The echo reward, awaited: a call sleeps 0.2 s (a judge model's round trip)."""
    await asyncio.sleep(0.2)
    return 1.0 if completion.startswith(answer) else 0.0


def shorter_is_better(prompt: str, completion: str, answer: str) -> float:
    return -len(completion) / 10


# Calls of the batched rewards in this process, and the batch sizes: one call per rank, step
# and source is what the tests check.
BATCH_CALLS: list[int] = []


@batched
async def async_batch_starts_with_answer(
    prompts: list[str], completions: list[str], answers: list[str]
) -> list[float]:
    """The echo reward for a whole batch, in one awaited call; logs its calls (the rank's
    dump folder, from TORCHTITAN_RL_CALLS_TO, when set) so a run's test can count them."""
    BATCH_CALLS.append(len(completions))
    log = os.environ.get("TORCHTITAN_RL_CALLS_TO")
    if log:
        with open(f"{log}.rank{os.environ.get('RANK', '0')}", "a") as f:
            f.write(f"{len(completions)}\n")
    await asyncio.sleep(0.05)
    return [1.0 if c.startswith(a) else 0.0 for c, a in zip(completions, answers, strict=True)]


@batched
def batch_drops_one(prompts: list[str], completions: list[str], answers: list[str]) -> list:
    return [1.0] * (len(completions) - 1)


def not_a_number(prompt: str, completion: str, answer: str):
    return "1.0"


def letters_of_answer(prompt: str, completion: str, answer: str) -> float:
    """The share of the answer's letters the completion holds: a random model's samples differ
    on it, so every group has advantages and every step trains (the exact match a random model
    never scores)."""
    letters = set(answer)
    return len(letters & set(completion)) / len(letters)
