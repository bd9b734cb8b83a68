"""Checkpoints: exact resume after SIGKILL, torn checkpoints skipped, async saves, HF export.

Real runs: torchrun with 2 ranks, the real vLLM engine, DCP files on disk, SIGKILL.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers.launch import kill_tree, run_dist, start_train, wait_for_step
from safetensors.torch import load_file

from torchtitan_rl.checkpoint import MANIFEST, invalid_reason
from torchtitan_rl.metrics import _keep_rows_until

PROMPT, GREEDY_TOKENS = "echo 123:", 8
FLAGS = (
    "--job.config_file",
    "run_configs/debug_cpu.toml",
    "--training.steps",
    "6",
    "--training.lr",
    "1e-2",
    "--checkpoint.enable",
    "true",
    "--checkpoint.interval",
    "3",
    "--checkpoint.export_hf_at_end",
    "true",
)
# Wall-clock figures differ between runs; everything else must not.
TIMING = ("time/", "throughput/")


def rows(folder: Path) -> dict[int, dict]:
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    return {row["step"]: row for row in map(json.loads, lines)}


def weights(hf_folder: Path) -> dict[str, torch.Tensor]:
    return load_file(hf_folder / "model.safetensors")


@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> Path:
    """6 uninterrupted steps (checkpoints at 3 and 6), then the generator's greedy tokens."""
    out = tmp_path_factory.mktemp("full")
    run_dist(
        "train_then_greedy.py",
        PROMPT,
        str(GREEDY_TOKENS),
        *FLAGS,
        "--job.dump_folder",
        str(out),
        nproc=2,
    )
    return out


def kill_during_step_5(out: Path) -> None:
    """Start the run and SIGKILL the launcher and both ranks once step 4 is logged."""
    process = start_train(*FLAGS, "--job.dump_folder", str(out), nproc=2)
    try:
        wait_for_step(process, out, 4)
    finally:
        kill_tree(process)


def copy_of(full_run: Path, tmp_path: Path) -> Path:
    out = tmp_path / "copy"
    shutil.copytree(full_run / "checkpoints", out / "checkpoints")
    return out


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
