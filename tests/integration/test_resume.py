"""Stop a run mid-way, launch the same command again: it resumes from the last complete
checkpoint and ends as the uninterrupted run of the session did, row for row and bit for bit.

    .venv/bin/python -m pytest tests/integration/test_resume.py

One harness, four runs: RL (one rank SIGKILLed: the launcher stops the other quickly, and a
torn and an unfinished checkpoint are skipped on resume), LoRA RL and mixture-of-experts RL
with expert parallel (the launcher and every rank SIGKILLed), and SFT (SIGTERM to torchrun:
the step finishes and its checkpoint is written, watchdog.py). Real torchrun with 2 ranks, DCP
files, the real vLLM engine. RL preempted, colocated and disaggregated: test_long_runs.py.
"""

import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import psutil
import pytest
from helpers import runs
from helpers.launch import (
    assert_resumed_as,
    kill_tree,
    preempt,
    run_train,
    start_train,
    wait_for_step,
)
from torch.distributed.checkpoint import FileSystemReader

from torchtitan_rl.checkpoint import invalid_reason


@dataclass(frozen=True)
class Case:
    reference: str  # the session fixture of the uninterrupted run
    flags: tuple[str, ...]
    module: str
    kill_after: int  # the step whose row is logged before the stop
    resumed_from: int | None  # the last complete checkpoint then (None: the preempted step's)
    last_step: int
    stop: Literal["kill_rank_1", "kill_all", "sigterm"]
    """SIGKILL rank 1 alone, or the launcher and every rank; or SIGTERM to the launcher."""
    exact: bool  # rows equal exactly (else within 1e-6)


# The RL case is killed and resumed with the model's shape read from the checkpoint's
# config.json (model.flavor = "auto"), the reference run with the flavor named: the rows agree.
CASES = {
    "rl": Case(
        "reference_run",
        (*runs.REFERENCE, "--model.flavor", "auto"),
        "torchtitan_rl.train",
        4,
        3,
        6,
        "kill_rank_1",
        False,
    ),
    "lora": Case("lora_run", runs.LORA, "torchtitan_rl.train", 4, 3, 6, "kill_all", False),
    "moe": Case("moe_run", runs.MOE, "torchtitan_rl.train", 4, 3, 6, "kill_all", False),
    "sft": Case("sft_run", runs.SFT, "torchtitan_rl.sft", 12, None, 30, "sigterm", True),
}


def kill_one_rank(process, out: Path, step: int) -> None:
    """SIGKILL rank 1 once `step` is logged: the launcher must stop rank 0 and exit non-zero
    within 60 s, leaving no rank behind."""
    try:
        wait_for_step(process, out, step)
        ranks = psutil.Process(process.pid).children(recursive=True)
        rank_1 = next(p for p in ranks if p.environ().get("LOCAL_RANK") == "1")
        killed_at = time.monotonic()
        rank_1.kill()
        process.wait(timeout=120)
        ended_after = time.monotonic() - killed_at
    finally:
        kill_tree(process)
    assert process.returncode != 0
    assert ended_after < 60, f"the surviving rank took {ended_after:.0f} s to stop"
    assert not [p for p in ranks if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def tear(checkpoints: Path, complete: int, torn: int, unfinished: int) -> None:
    """A save torn by a crash (step `torn`: a truncated shard) and one that never finished
    (step `unfinished`: a .tmp folder)."""
    shutil.copytree(checkpoints / f"step-{complete}", checkpoints / f"step-{torn}")
    shard = checkpoints / f"step-{torn}" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    (checkpoints / f"step-{unfinished}.tmp").mkdir(exist_ok=True)
    (checkpoints / f"step-{unfinished}.tmp" / "__0_0.distcp").write_bytes(b"partial")


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.shares(c.reference)) for n, c in CASES.items()]
)
def test_a_stopped_run_resumes_as_the_uninterrupted_run(name, request, tmp_path):
    case = CASES[name]
    reference = request.getfixturevalue(case.reference)
    reference = getattr(reference, "folder", reference)
    out = tmp_path / "killed"
    flags = (*case.flags, "--job.dump_folder", str(out))
    resumed_from = case.resumed_from
    if case.stop == "sigterm":
        resumed_from = preempt(
            case.flags, out, case.kill_after, signal.SIGTERM, rank=None, module=case.module
        )
        assert resumed_from % 10, resumed_from  # a step whose checkpoint was not due
    else:
        process = start_train(*flags, nproc=2, module=case.module)
        if case.stop == "kill_rank_1":
            kill_one_rank(process, out, case.kill_after)
        else:
            try:
                wait_for_step(process, out, case.kill_after)
            finally:
                kill_tree(process)
    checkpoints = out / "checkpoints"
    assert invalid_reason(checkpoints / f"step-{resumed_from}") is None
    assert not (checkpoints / f"step-{case.last_step}").exists(), "killed too late"
    if name == "rl":
        tear(checkpoints, resumed_from, torn=5, unfinished=6)

    result = run_train(*flags, nproc=2, module=case.module)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed from {checkpoints / f'step-{resumed_from}'}" in result.stdout
    if name == "rl":
        assert f"skipping checkpoint {checkpoints / 'step-5'}: __1_0.distcp has" in result.stderr
        assert f"removing {checkpoints / 'step-6.tmp'}" in result.stderr
    if name == "lora":
        # The checkpoint holds the adapters, optimizer and train state, not the frozen weights.
        saved = FileSystemReader(checkpoints / "step-3").read_metadata().state_dict_metadata
        model_keys = [k for k in saved if not k.startswith(("optimizer", "lr_scheduler", "train"))]
        assert len(model_keys) == 20 and all(".lora_" in k for k in model_keys), model_keys

    assert_resumed_as(reference, out, resumed_from, exact=case.exact)
