"""Checkpoint bookkeeping: what makes a checkpoint folder incomplete, and the metric rows a
resume keeps. Real saves, exports and resumes: tests/integration/test_checkpoint.py and
test_resume.py.

    .venv/bin/python -m pytest tests/unit/test_checkpoint.py
"""

import json

from torchtitan_rl.checkpoint import MANIFEST, invalid_reason
from torchtitan_rl.metrics import _keep_rows_until

PROMPT, GREEDY_TOKENS = "echo 123:", 8


def test_invalid_reason_names_what_is_wrong(tmp_path):
    folder = tmp_path / "step-1"
    folder.mkdir()
    assert invalid_reason(folder) == f"no {MANIFEST} (a save that did not finish)"
    (folder / "a.distcp").write_bytes(b"12345")
    (folder / MANIFEST).write_text(json.dumps({"files": {"a.distcp": 5}}))
    assert invalid_reason(folder) is None
    (folder / "a.distcp").write_bytes(b"123")
    assert invalid_reason(folder) == "a.distcp has 3 bytes, the manifest says 5"
    (folder / "a.distcp").unlink()
    assert invalid_reason(folder) == "a.distcp is missing"
    (folder / MANIFEST).write_text("{")
    assert invalid_reason(folder).startswith(f"unreadable {MANIFEST}")


def test_resume_keeps_metric_rows_up_to_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n{"step": 4, "cut')
    _keep_rows_until(path, 2)
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'
    _keep_rows_until(path, 0)
    assert path.read_text() == ""
