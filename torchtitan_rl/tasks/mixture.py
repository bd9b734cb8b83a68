"""A weighted mixture of sources: each step's prompts drawn by weight, seeded and indexed by step.

    .venv/bin/python -m pytest tests/unit/test_tasks.py -k mixture

Step s draws the source of each of its prompts with a multinomial seeded by (job.seed, s, round),
so the draw is the same on every rank, on resume, and for any placement. A source's rows are
read from its cursor: the number of prompts it was given in the steps before s (round 0's), so
each source walks its own stream (a dataset in fresh seeded orders per epoch) without gaps.
Shapes: S sources.
"""

import dataclasses
import random

from torchtitan_rl.tasks.base import Task
from torchtitan_rl.types import Prompt


class Mixture:
    """The Task of a run with task.sources: `tasks[name]` weighted by `weights[name]`."""

    def __init__(self, tasks: dict[str, Task], weights: dict[str, float], seed: int = 0):
        self.names = list(tasks)
        self.tasks, self.seed = tasks, seed
        self.weights_S = [weights[name] for name in self.names]
        # cursors[count][s - 1]: each source's cursor at step s, for steps of `count` prompts.
        self._cursors: dict[int, list[list[int]]] = {}

    def draw(self, step: int, count: int, round: int = 0) -> list[int]:
        """The source (an index into `names`) of each of the step's `count` prompts."""
        rng = random.Random(f"mixture/{self.seed}/{step}/{round}")
        return rng.choices(range(len(self.names)), weights=self.weights_S, k=count)

    def cursor(self, step: int, count: int) -> list[int]:
        """How many prompts each source gave in steps 1 .. step - 1 (their first rounds)."""
        cursors = self._cursors.setdefault(count, [[0] * len(self.names)])
        while len(cursors) < step:
            counts = cursors[-1].copy()
            for source in self.draw(len(cursors), count):
                counts[source] += 1
            cursors.append(counts)
        return cursors[step - 1]

    def prompts(self, step: int, count: int, round: int = 0) -> list[Prompt]:
        drawn = self.draw(step, count, round)
        cursor = self.cursor(step, count)
        rows = [
            iter(self.tasks[name].rows(cursor[s], drawn.count(s), round))
            for s, name in enumerate(self.names)
        ]
        return [dataclasses.replace(next(rows[s]), source=self.names[s]) for s in drawn]

    def every_prompt(self) -> list[Prompt]:
        return [
            dataclasses.replace(prompt, source=name)
            for name, task in self.tasks.items()
            for prompt in task.every_prompt()
        ]

    def rows(self, start: int, count: int, round: int = 0) -> list[Prompt]:
        raise NotImplementedError("a mixture is not a source of another mixture")

    def reward(self, prompt: Prompt, completion: str) -> float:
        return self.tasks[prompt.source].reward(prompt, completion)
