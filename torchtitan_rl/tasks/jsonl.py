"""Prompts from a JSONL file of {"prompt": ..., "answer": ...} rows, scored by math-verify.

.venv/bin/python -m pytest tests/test_tasks.py
"""

import json
import random
from pathlib import Path

from torchtitan_rl.config.job_config import ConfigError
from torchtitan_rl.tasks.base import Prompt
from torchtitan_rl.tasks.rewards import math_reward


def read_jsonl(path: str) -> list[Prompt]:
    """Every row of `path`; a bad file or line is a ConfigError naming file:line."""
    try:
        lines = Path(path).read_bytes().decode("utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise ConfigError(f"task.dataset_path = {path!r} is not UTF-8 text ({e.reason})") from None
    prompts = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{number}: not a JSON object ({e.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise ConfigError(f'{path}:{number}: needs a string "prompt" (and an "answer")')
        if not row["prompt"].strip():
            raise ConfigError(f"{path}:{number}: the prompt is empty")
        prompts.append(
            Prompt(text=row["prompt"], answer=str(row.get("answer", "")), source=f"{path}:{number}")
        )
    if not prompts:
        raise ConfigError(f"task.dataset_path = {path!r} has no rows")
    return prompts


class JsonlTask:
    """Cycles through the file in a fresh seeded order every epoch."""

    def __init__(self, path: str, seed: int = 0):
        self.rows = read_jsonl(path)
        self.seed = seed

    def prompts(self, step: int, count: int, round: int = 0) -> list[Prompt]:
        start = (step - 1) * count
        return [self._row(i, round) for i in range(start, start + count)]

    def _row(self, index: int, round: int = 0) -> Prompt:
        """Row `index` of the dataset read in epochs, each shuffled; round r > 0 reads its own
        shuffles (dynamic sampling's further prompts)."""
        epoch, position = divmod(index, len(self.rows))
        order = list(range(len(self.rows)))
        stream = self.seed * 1_000_003 + epoch
        random.Random(stream if round == 0 else f"{stream}/{round}").shuffle(order)
        return self.rows[order[position]]

    def every_prompt(self) -> list[Prompt]:
        return self.rows

    def reward(self, prompt: Prompt, completion: str) -> float:
        return math_reward(prompt.text, completion, prompt.answer)
