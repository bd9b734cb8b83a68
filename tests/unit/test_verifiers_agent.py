"""torchtitan_rl.verifiers_agent's rows: written one per task, read back to their task. The
server itself runs verifiers in .venv-verifiers: tests/integration/test_gateway.py.

    .venv/bin/python -m pytest tests/unit/test_verifiers_agent.py
"""

import json
from types import SimpleNamespace

import pytest

from torchtitan_rl.verifiers_agent import task_of, write_rows


def _task(prompt_text: str, name: str | None = None):
    return SimpleNamespace(data=SimpleNamespace(prompt_text=prompt_text, name=name))


def test_each_row_maps_back_to_its_task_and_a_foreign_row_is_refused(tmp_path):
    tasks = [_task("max(1,2)="), _task(" min(3,4)= "), _task("", name="opens-itself"), _task("")]
    path = tmp_path / "rows" / "tasks.jsonl"
    write_rows(tasks, path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == [
        {"prompt": "max(1,2)=", "answer": ""},
        {"prompt": "min(3,4)=", "answer": ""},
        {"prompt": "opens-itself", "answer": ""},
        {"prompt": "verifiers task 3", "answer": ""},
    ]
    for number, row in enumerate(rows, start=1):  # the row the trainer sends (tasks.agent.row_of)
        assert task_of(tasks, {**row, "row": f"/data/x:y.jsonl:{number}"}) is tasks[number - 1]
    with pytest.raises(ValueError, match=r"row x.jsonl:2 is not task 1 of this taskset"):
        task_of(tasks, {"prompt": "max(1,2)=", "row": "x.jsonl:2"})
    for where in ("x.jsonl:5", "x.jsonl:0", "x.parquet"):
        with pytest.raises(ValueError, match="is not one of this taskset's 4 rows"):
            task_of(tasks, {"prompt": "max(1,2)=", "row": where})
