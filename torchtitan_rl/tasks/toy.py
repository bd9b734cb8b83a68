"""Offline toy tasks small enough that the tiny random-init model learns them with RL alone.

.venv/bin/python -m pytest tests/unit/test_tasks.py
"""

import random

from torchtitan_rl.types import Prompt


class EchoDigitsTask:
    """'echo 407:' -> '407'. Dense reward: the fraction of digit positions echoed right."""

    verb = "echo"

    def __init__(self, *, num_digits: int = 1, seed: int = 0):
        self.num_digits = num_digits
        self.seed = seed

    def answer(self, digits: str) -> str:
        return digits

    def prompts(self, step: int, count: int, round: int = 0) -> list[Prompt]:
        # Round r continues the step's stream: its prompts follow those of rounds < r.
        rng = random.Random(self.seed * 1_000_003 + step)
        prompts = []
        for _ in range((round + 1) * count):
            digits = "".join(rng.choice("0123456789") for _ in range(self.num_digits))
            prompts.append(Prompt(text=f"{self.verb} {digits}:", answer=self.answer(digits)))
        return prompts[round * count :]

    def rows(self, start: int, count: int, round: int = 0) -> list[Prompt]:
        """Positions start .. start + count of an endless stream, each prompt seeded by its
        position (a mixture reads a source from its cursor)."""
        prompts = []
        for index in range(start, start + count):
            rng = random.Random(f"{self.seed}/{round}/{index}")
            digits = "".join(rng.choice("0123456789") for _ in range(self.num_digits))
            prompts.append(Prompt(text=f"{self.verb} {digits}:", answer=self.answer(digits)))
        return prompts

    def every_prompt(self) -> list[Prompt]:
        return self.prompts(1, 1)  # every prompt has num_digits digits: the same length

    def reward(self, prompt: Prompt, completion: str) -> float:
        hits = sum(a == b for a, b in zip(prompt.answer, completion, strict=False))
        return hits / len(prompt.answer)


class ReverseDigitsTask(EchoDigitsTask):
    """'reverse 407:' -> '704'. Same dense reward; harder: the copy runs backwards."""

    verb = "reverse"

    def answer(self, digits: str) -> str:
        return digits[::-1]
