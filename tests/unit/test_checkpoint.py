"""Checkpoint bookkeeping: what makes a checkpoint folder incomplete, the metric rows a resume
keeps, and a save refused for want of room (a real save in a world of one). Real saves, exports
and resumes under torchrun: tests/integration/test_checkpoint.py and test_resume.py.

    .venv/bin/python -m pytest tests/unit/test_checkpoint.py
"""

import json
import shutil

import pytest
from helpers.launch import REPO

from torchtitan_rl import platform
from torchtitan_rl.checkpoint import (
    MANIFEST,
    SAVE_MARGIN_BYTES,
    Checkpointer,
    CheckpointError,
    TrainState,
    invalid_reason,
    save_bytes,
)
from torchtitan_rl.config import (
    CheckpointSection,
    ConfigError,
    ModelSection,
    ParallelismSection,
    TrainingSection,
)
from torchtitan_rl.metrics import _keep_rows_until
from torchtitan_rl.trainer.policy_trainer import PolicyTrainer

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
    # A line of bytes that are not UTF-8 (a damaged disk block) is skipped as a cut one is.
    path.write_bytes(b'{"step": 1}\n\xff\xfe\n{"step": 2}\n{"step": 3}\n{"step": 4, "cut')
    _keep_rows_until(path, 2)
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'
    _keep_rows_until(path, 0)
    assert path.read_text() == ""


def tiny_trainer() -> PolicyTrainer:
    """A PolicyTrainer of the tiny checkpoint in a world of one."""
    platform.patch_torchtitan()
    platform.init_distributed()
    return PolicyTrainer(
        model=ModelSection(hf_checkpoint=str(REPO / "assets" / "tiny_qwen3")),
        training=TrainingSection(),
        parallelism=ParallelismSection(),
    )


def test_a_save_that_cannot_fit_is_refused_before_any_byte_and_keeps_the_last(
    tmp_path, monkeypatch
):
    """A real save (one process, the tiny model) fits in its estimate; with the free space
    below the estimate the next save raises one line naming the step, the sizes and the latest
    checkpoint, and writes nothing: no step-2 folder, step-1 still complete."""
    trainer = tiny_trainer()
    checkpointer = Checkpointer(
        CheckpointSection(enable=True), str(tmp_path), {"model": {"name": "qwen3"}}
    )
    checkpointer.attach(trainer, TrainState())
    checkpointer.save(1)
    folder = tmp_path / "checkpoints"
    written = sum(p.stat().st_size for p in (folder / "step-1").rglob("*") if p.is_file())
    estimate = save_bytes(trainer)
    # The estimate covers what a save writes, and not many times over.
    assert written <= estimate + SAVE_MARGIN_BYTES and estimate <= 2 * written

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(
        shutil, "disk_usage", lambda path: usage._replace(free=estimate + SAVE_MARGIN_BYTES - 1)
    )
    with pytest.raises(CheckpointError) as refused:
        checkpointer.save(2)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("step 2: the checkpoint needs about")
    assert "so nothing was written; the latest complete checkpoint is still step-1" in message
    assert sorted(p.name for p in folder.iterdir()) == ["step-1"]
    assert invalid_reason(folder / "step-1") is None

    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage)
    checkpointer.save(2)  # with room, the same save goes through
    assert invalid_reason(folder / "step-2") is None


def test_a_checkpoint_damaged_in_place_is_one_line(tmp_path):
    """Files of the sizes the manifest records but bytes that do not load (zeroed): resuming
    from them is one line naming the step folder, not DCP's report."""
    trainer = tiny_trainer()
    facts = {"model": {"name": "qwen3", "flavor": "tiny"}, "lora": None, "seed": 0}
    facts["prompts_per_step"] = 8
    saver = Checkpointer(CheckpointSection(enable=True), str(tmp_path / "saved"), facts)
    saver.attach(trainer, TrainState())
    saver.save(1)
    for name in (".metadata", "__0_0.distcp"):
        shutil.copytree(tmp_path / "saved", tmp_path / name)
        path = tmp_path / name / "checkpoints" / "step-1" / name
        path.write_bytes(bytes(path.stat().st_size))
        checkpointer = Checkpointer(CheckpointSection(enable=True), str(tmp_path / name), facts)
        checkpointer.attach(trainer, TrainState())
        with pytest.raises(ConfigError) as error:
            checkpointer.load(checkpointer.find())
        message = str(error.value)
        assert "\n" not in message and f"{path.parent} is damaged (" in message, message
        assert name.split("_")[0] in message and "checkpoint.resume_from" in message, message
