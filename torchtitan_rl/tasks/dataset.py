"""Prompts from local JSONL, JSON or Parquet files (or a folder of shards), read with `datasets`.

.venv/bin/python -m pytest tests/unit/test_datasets.py

A row holds a prompt (a string under `prompt_key`, or a list of chat messages under
`messages_key`) and an answer under `answer_key`; GSM8K's answers ("... #### 42") keep what
follows "####" with `answer_format = "gsm8k"`. Every row is checked when the dataset is opened
and a bad one is a ConfigError naming file:row (rows count from 1; in JSONL, row N is line N).
"""

import functools
import json
import os
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path

from torchtitan_rl.config import ConfigError
from torchtitan_rl.tasks.rewards import math_reward
from torchtitan_rl.types import Prompt, is_chat
from torchtitan_rl.vision.prompts import image_parts

# Nothing is downloaded: local files only.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


@dataclass(frozen=True, slots=True)
class DatasetKeys:
    """Where a row keeps its prompt and answer (task.prompt_key and friends)."""

    prompt_key: str = "prompt"
    messages_key: str | None = None
    answer_key: str | None = "answer"
    """None: rows need no answer (SFT rows of messages carry theirs as assistant turns)."""
    answer_format: str = "raw"
    at: str = "task"
    """The config section these keys come from (task, or task.sources.NAME), for errors."""


def dataset_files(path: str, field: str = "task.dataset_path") -> list[Path]:
    """The file at `path`, or the dataset files of the folder at `path` in name order."""
    root = Path(path)
    if root.is_file():
        files = [root]
    elif root.is_dir():
        files = sorted(f for f in root.iterdir() if f.suffix in FORMATS and f.is_file())
    else:
        raise ConfigError(f"{field} = {path!r}: no such file or folder")
    for file in files:
        if file.suffix not in FORMATS:
            raise ConfigError(
                f"{field} = {path!r}: {file.name} is not a .jsonl, .json or .parquet file"
            )
    if not files:
        raise ConfigError(f"{field} = {path!r}: the folder holds no .jsonl, .json or .parquet file")
    return files


def read_rows(path: str, keys: DatasetKeys, field: str = "task.dataset_path") -> list[Prompt]:
    """Every row of the dataset at `path` as a Prompt; a bad row is a ConfigError (file:row)."""
    prompts = []
    for file in dataset_files(path, field):
        for number, row in enumerate(_load(file, keys, field), start=1):
            prompts.append(_prompt(row, keys, f"{file}:{number}", file.parent))
    if not prompts:
        raise ConfigError(f"{field} = {path!r} has no rows")
    return prompts


def _load(file: Path, keys: DatasetKeys, field: str) -> list[dict]:
    """The rows of one file, read by `datasets` (in memory, its cache in a scratch folder)."""
    import datasets

    datasets.disable_progress_bars()
    reader = {"json": datasets.Dataset.from_json, "parquet": datasets.Dataset.from_parquet}
    # It logs a damaged Parquet file as an error before raising: the one line below says it.
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    with tempfile.TemporaryDirectory() as cache:
        try:
            table = reader[FORMATS[file.suffix]](str(file), keep_in_memory=True, cache_dir=cache)
        except Exception as e:  # datasets raises many types for a malformed file
            if file.suffix != ".parquet" and not file.read_bytes().strip():
                return []  # blank: no rows, which datasets does not accept
            raise ConfigError(_unreadable(file, keys, field, e)) from None
        finally:
            datasets.logging.set_verbosity(verbosity)
    # Decoded through the features (`to_list` is not): a column of contents that are strings
    # in some rows and lists of parts in others is a `Json` feature, JSON text until decoded.
    columns = table[:]
    return [
        dict(zip(columns, values, strict=True)) for values in zip(*columns.values(), strict=True)
    ]


def _unreadable(file: Path, keys: DatasetKeys, field: str, error: Exception) -> str:
    """One line for a file `datasets` could not read; for JSON Lines, the first bad line (not
    JSON, or a row without the keys: `datasets` fails on rows whose columns differ); for JSON,
    where it stops being JSON."""
    reason = str(error).splitlines()[0] if str(error) else type(error).__name__
    if file.suffix == ".parquet":  # pyarrow's reason: no footer, a size too small, ...
        return (
            f"{field}: cannot read {file} ({reason}): is it a whole Parquet file? write or "
            "download it again"
        )
    try:
        text = file.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        return f"{field}: {file} is not UTF-8 text ({e.reason} at byte {e.start})"
    if file.suffix == ".json":
        try:
            json.loads(text)
        except json.JSONDecodeError as e:
            return (
                f"{field}: {file} is not valid JSON ({e.msg}: line {e.lineno} column "
                f"{e.colno}; cut short?): write or download it again"
            )
    if file.suffix == ".jsonl":
        for number, line in enumerate(text.splitlines(), start=1):
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                return f"{file}:{number}: not a JSON object ({e.msg}); one object per line"
            if not isinstance(row, dict):
                return f"{file}:{number}: not a JSON object; one object per line"
            try:
                _prompt(row, keys, f"{file}:{number}")
            except ConfigError as e:
                return str(e)
    return f"{field}: cannot read {file} ({reason})"


def _prompt(row: dict, keys: DatasetKeys, where: str, folder: Path | None = None) -> Prompt:
    messages, images = None, ()
    if keys.messages_key is not None:
        messages = _messages(row.get(keys.messages_key), keys, where, folder)
        images = tuple(image_parts(messages))
        text = next((_text(m["content"]) for m in reversed(messages) if m["role"] == "user"), "")
    else:
        text = row.get(keys.prompt_key)
        if not isinstance(text, str):
            raise ConfigError(
                f'{where}: needs a string "{keys.prompt_key}" ({keys.at}.prompt_key); '
                f"the row has {sorted(row)}"
            )
        if not text.strip():
            raise ConfigError(f"{where}: the prompt is empty")
    answer = ""
    if keys.answer_key is not None:
        if row.get(keys.answer_key) is None:
            raise ConfigError(
                f'{where}: needs an "{keys.answer_key}" ({keys.at}.answer_key); the row has '
                f"{sorted(row)}"
            )
        answer = _answer(str(row[keys.answer_key]), keys.answer_format, where)
    return Prompt(text=text, answer=answer, row=where, messages=messages, images=images)


def _messages(value, keys: DatasetKeys, source: str, folder: Path | None) -> tuple[dict, ...]:
    bad = ConfigError(
        f'{source}: "{keys.messages_key}" ({keys.at}.messages_key) must be a non-empty list of '
        '{"role": ..., "content": ...} messages, each content a string or a list of '
        '{"type": "text" | "image" | "image_url", ...} parts'
    )
    if not (value and isinstance(value, list)):
        raise bad
    messages = []
    for m in value:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, int | float) and not isinstance(content, bool):
            content = json.dumps(content)  # a `Json` column decodes the string "4" to 4
        if isinstance(content, list):
            content = _parts(content, folder, bad)
        messages.append(
            {"role": m.get("role") if isinstance(m, dict) else None, "content": content}
        )
    if not is_chat(messages):
        raise bad
    if not any(_text(m["content"]).strip() or not isinstance(m["content"], str) for m in messages):
        raise ConfigError(f"{source}: the prompt is empty")
    return tuple(messages)


def _parts(parts: list, folder: Path | None, bad: ConfigError) -> str | list[dict]:
    """A message's content parts, as the chat template reads them: text parts alone are joined
    into a string; an image's path is resolved against the dataset file's `folder`, and an HF
    `datasets` Image feature ({"bytes", "path"}) becomes its bytes (or its path)."""
    found = []
    for part in parts:
        if isinstance(part, str):  # `datasets` writes parts of mixed keys as JSON strings
            try:
                part = json.loads(part)
            except json.JSONDecodeError:
                raise bad from None
        if not isinstance(part, dict) or part.get("type") not in ("text", "image", "image_url"):
            raise bad
        kind = part["type"]
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise bad
            found.append({"type": "text", "text": part["text"]})
            continue
        image = part.get(kind)
        if kind == "image_url" and isinstance(image, dict):
            image = image.get("url")
        if isinstance(image, dict):  # an HF datasets Image feature
            image = image.get("bytes") or image.get("path")
        if isinstance(image, str) and not image.startswith("data:") and folder is not None:
            image = str(folder / image)  # absolute paths stay as they are
        if not isinstance(image, str | bytes):
            raise bad
        found.append({"type": "image", "image": image})
    if all(part["type"] == "text" for part in found):
        return "".join(part["text"] for part in found)
    return found


def _text(content: str | list[dict]) -> str:
    """A message's text (its text parts, joined)."""
    if isinstance(content, str):
        return content
    return "".join(part["text"] for part in content if part["type"] == "text")


def _answer(answer: str, answer_format: str, source: str) -> str:
    """The answer a reward compares with: GSM8K's keeps what follows '####'."""
    if answer_format == "raw":
        return answer
    head, mark, tail = answer.rpartition("####")
    if not mark or not tail.strip():
        raise ConfigError(
            f"{source}: task.answer_format = 'gsm8k' but the answer has no '#### <answer>' "
            f"line: {answer[-60:]!r}"
        )
    return tail.strip().replace(",", "")


def epoch_order(rows: int, index: int, seed: int, round: int = 0) -> int:
    """The row at position `index` of a dataset of `rows` rows read in epochs, each in a fresh
    order seeded by (seed, epoch); round r > 0 reads its own orders."""
    epoch, position = divmod(index, rows)
    return _shuffled(rows, seed * 1_000_003 + epoch, round)[position]


@functools.lru_cache(maxsize=4)
def _shuffled(rows: int, stream: int, round: int) -> tuple[int, ...]:
    order = list(range(rows))
    random.Random(stream if round == 0 else f"{stream}/{round}").shuffle(order)
    return tuple(order)


class DatasetTask:
    """Cycles through the dataset in a fresh seeded order every epoch; math-verify rewards."""

    def __init__(
        self, path: str, keys: DatasetKeys, seed: int = 0, field: str = "task.dataset_path"
    ):
        self.table = read_rows(path, keys, field)
        self.seed = seed

    def prompts(self, step: int, count: int, round: int = 0) -> list[Prompt]:
        return self.rows((step - 1) * count, count, round)

    def rows(self, start: int, count: int, round: int = 0) -> list[Prompt]:
        """Positions start .. start + count of the endless stream of rows (a mixture reads a
        source from its cursor)."""
        return [self._row(i, round) for i in range(start, start + count)]

    def _row(self, index: int, round: int = 0) -> Prompt:
        """Row `index` of the dataset read in epochs, each shuffled; round r > 0 reads its own
        shuffles (dynamic sampling's further prompts)."""
        return self.table[epoch_order(len(self.table), index, self.seed, round)]

    def every_prompt(self) -> list[Prompt]:
        return self.table

    def reward(self, prompt: Prompt, completion: str) -> float:
        return math_reward(prompt.text, completion, prompt.answer)
