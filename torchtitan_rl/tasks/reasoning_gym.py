"""Questions of reasoning-gym's procedural generators, scored by each generator's own scorer.

    .venv/bin/python -m pytest tests/unit/test_reasoning_gym.py

`task.name = "reasoning_gym"` generates task.reasoning_gym_size entries of the generator
task.reasoning_gym (its settings: the [task.reasoning_gym_config] table) with
task.reasoning_gym_seed, offline. Each entry's question is a prompt (the user message, after
task.system_prompt, in the checkpoint's chat template), read in seeded epochs like a dataset's
rows. A reply's reward is the generator's `score_answer(extracted, entry)`: 1.0 for a right
answer, a little partial credit for some wrong ones, 0 when nothing is extracted. What is
extracted is one rule, task.answer_extraction, the same in training and in every evaluation.
Beside it, the scorer's value on the whole reply is a figure (reward/raw, eval/reward/raw): a
reply that is right but not in the generator's format scores raw < extracted.

The held-out set: task.reasoning_gym_eval_size entries generated with another seed, less every
entry whose question a training entry has (dropped, so the two share no question). When more
than half would be dropped it is refused: the seeds overlap, or the settings leave too few
distinct questions for a held-out set to mean anything.

An unknown generator or setting, settings the generator refuses, and (last_number) answers that
are not numbers are one ConfigError line when the task is opened, before any model is built.
"""

import dataclasses
import difflib
import functools
import importlib.metadata
import re
from collections.abc import Callable

from torchtitan_rl.config import ConfigError
from torchtitan_rl.config.task import SourceSection
from torchtitan_rl.tasks.dataset import epoch_order
from torchtitan_rl.tasks.rewards import Reward
from torchtitan_rl.types import Prompt

# A number as a reply writes it, sign, thousands separators and decimals ("-1,250.5"); not the
# tail of a word or of another number ("x2" has none, "3-4" has 3 and 4).
_NUMBER = re.compile(r"(?<![\w.])-?\d+(?:,\d{3})*(?:\.\d+)?")


def last_number(reply: str) -> str | None:
    """The reply's last number without thousands separators ('... 1,250 - 3 = 1,247.' ->
    '1247'); None when it has none."""
    numbers = _NUMBER.findall(reply)
    return numbers[-1].replace(",", "") if numbers else None


def answer_tags(reply: str) -> str | None:
    """What the reply's last <answer>...</answer> holds, stripped (reasoning-gym's own
    `extract_answer`, the format its system prompts ask for); None without the tags."""
    from reasoning_gym.utils import extract_answer

    return extract_answer(reply)


def raw_reply(reply: str) -> str | None:
    """The whole reply, without surrounding whitespace."""
    return reply.strip()


# task.answer_extraction's rules (the config's Literal lists these names).
EXTRACTIONS: dict[str, Callable[[str], str | None]] = {
    "last_number": last_number,
    "answer_tags": answer_tags,
    "raw": raw_reply,
}


@functools.cache
def _registry() -> dict[str, tuple[type, type]]:
    """reasoning-gym's generators by name: (dataset class, config class). Its factory's
    registry, read here alone: the package lists its generators nowhere else."""
    from reasoning_gym.factory import DATASETS

    return DATASETS


def generators() -> list[str]:
    """Every generator reasoning-gym knows, by name."""
    return sorted(_registry())


def settings(generator: str) -> list[str]:
    """The settings of `generator`'s config class, less seed and size (the task's own fields)."""
    _, config_class = _registry()[generator]
    return [f.name for f in dataclasses.fields(config_class) if f.name not in ("seed", "size")]


def check_generator(generator: str, config: dict, at: str = "task") -> None:
    """A ConfigError naming the field when reasoning-gym has no generator `generator`, or the
    generator no setting of `config`; the valid names are listed."""
    known = generators()
    if generator not in known:
        version = importlib.metadata.version("reasoning-gym")
        raise ConfigError(
            f"{at}.reasoning_gym = {generator!r}: reasoning-gym {version} has no such generator: "
            f"{_hint(generator, known)}its generators: {', '.join(known)}"
        )
    valid = settings(generator)
    for key in config:
        if key not in valid:
            raise ConfigError(
                f"{at}.reasoning_gym_config.{key}: {generator} has no such setting: "
                f"{_hint(key, valid)}its settings: {', '.join(valid)}"
            )


def _hint(name: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(name, valid, n=3)
    return f"did you mean {', '.join(close)}? " if close else ""


def generate(generator: str, config: dict, *, seed: int, size: int, at: str = "task"):
    """The generator's dataset and its `size` entries ({"question", "answer", "metadata"}) of
    `seed`; settings the generator refuses are a ConfigError naming the table."""
    from reasoning_gym import create_dataset

    try:
        dataset = create_dataset(generator, seed=seed, size=size, **config)
        return dataset, list(dataset)
    except Exception as e:  # its config checks are asserts; a wrong type raises TypeError
        _, config_class = _registry()[generator]
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(
            f"{at}.reasoning_gym_config = {config!r}: {generator} refuses it ({reason}): fix "
            f"the settings (their defaults: {config_class.__module__}.{config_class.__name__})"
        ) from None


def held_out(
    train: list[dict], entries: list[dict], field: str, seed: int, free: int
) -> list[dict]:
    """`entries` less those whose question a training entry has; a ConfigError naming `field`
    (the held-out seed, `seed`) when that drops more than half of them. `free`: the first seed
    past those the training entries took."""
    questions = {entry["question"] for entry in train}
    kept = [entry for entry in entries if entry["question"] not in questions]
    if 2 * len(kept) < len(entries):
        raise ConfigError(
            f"{field} = {seed}: {len(entries) - len(kept)} of the {len(entries)} held-out "
            f"questions are training questions too: use a seed of {free} or more (a generator "
            "seeds entry i with seed + i), or settings that make more distinct questions"
        )
    return kept


def check_numbers(entries: list[dict], generator: str, at: str = "task") -> None:
    """Every answer a number, which last_number can extract; else a ConfigError."""
    for entry in entries:
        if entry["answer"] is None or not _NUMBER.fullmatch(str(entry["answer"])):
            raise ConfigError(
                f"{at}.answer_extraction = 'last_number' (also when unset) but {generator}'s "
                f"answer {entry['answer']!r} is not a number: set {at}.answer_extraction = "
                f"'answer_tags' (and ask for <answer> tags in {at}.system_prompt) or 'raw'"
            )


class ReasoningGymTask:
    """One generator's entries: the training prompts in a fresh seeded order every epoch, the
    held-out prompts, and their scores (the generator's score_answer)."""

    def __init__(self, source: SourceSection, seed: int = 0, at: str = "task"):
        """`source`: the section (at `at`) with name = reasoning_gym; `seed`: job.seed, which
        orders the entries (task.reasoning_gym_seed makes them)."""
        generator, config = source.reasoning_gym, source.reasoning_gym_config
        check_generator(generator, config, at)
        self.generator, self.seed = generator, seed
        self.extraction = source.answer_extraction or "last_number"
        self.extract = EXTRACTIONS[self.extraction]
        data_seed, size = source.reasoning_gym_seed, source.reasoning_gym_size
        dataset, train = generate(generator, config, seed=data_seed, size=size, at=at)
        self.score_answer = dataset.score_answer
        self.eval_seed = source.reasoning_gym_eval_seed
        if self.eval_seed is None:
            self.eval_seed = data_seed + size
        held = []
        if source.reasoning_gym_eval_size:
            _, entries = generate(
                generator, config, seed=self.eval_seed, size=source.reasoning_gym_eval_size, at=at
            )
            field = f"{at}.reasoning_gym_eval_seed"
            held = held_out(train, entries, field, self.eval_seed, data_seed + size)
        if self.extraction == "last_number":
            check_numbers(train + held, generator, at)
        # What a reply's score needs beside it: its question's entry (a repeated training
        # question keeps its first, which asks and answers the same).
        self.entries: dict[str, dict] = {}
        for entry in train + held:
            self.entries.setdefault(entry["question"], entry)
        self.table = [self._prompt(e, data_seed, i) for i, e in enumerate(train)]
        self.held_out = [self._prompt(e, self.eval_seed, i) for i, e in enumerate(held)]

    def _prompt(self, entry: dict, seed: int, index: int) -> Prompt:
        answer = "" if entry["answer"] is None else str(entry["answer"])
        where = f"{self.generator} (seed {seed}) entry {index}"
        return Prompt(text=entry["question"], answer=answer, row=where)

    def prompts(self, step: int, count: int, round: int = 0) -> list[Prompt]:
        return self.rows((step - 1) * count, count, round)

    def rows(self, start: int, count: int, round: int = 0) -> list[Prompt]:
        """Positions start .. start + count of the endless stream of training entries."""
        size = len(self.table)
        return [
            self.table[epoch_order(size, i, self.seed, round)] for i in range(start, start + count)
        ]

    def every_prompt(self) -> list[Prompt]:
        return self.table

    def score(self, question: str, reply: str, extract: Callable[[str], str | None]) -> float:
        """The generator's score of what `extract` takes from `reply` to `question` (0 when it
        takes nothing)."""
        extracted = extract(reply)
        if extracted is None:
            return 0.0
        return float(self.score_answer(extracted, self.entries[question]))

    def reward(self, prompt: Prompt, completion: str) -> float:
        return self.score(prompt.text, completion, self.extract)

    def rewards(self, source: str = "") -> list[Reward]:
        """The reward, the score of the extracted answer ("extracted", weight 1), and the score
        of the raw reply ("raw", weight 0: a figure, not rewarded); "extracted/SOURCE" and
        "raw/SOURCE" for the source SOURCE of a mixture, whose figures are its own."""
        suffix = f"/{source}" if source else ""
        return [
            Reward(f"extracted{suffix}", self._extracted, 1.0),
            Reward(f"raw{suffix}", self._raw, 0.0),
        ]

    def _extracted(self, question: str, completion: str, answer: str) -> float:
        return self.score(question, completion, self.extract)

    def _raw(self, question: str, completion: str, answer: str) -> float:
        return self.score(question, completion, raw_reply)
