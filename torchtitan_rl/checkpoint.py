"""Checkpoints a run can resume from exactly, written atomically (HF export: hf_export.py).

    .venv/bin/python -m pytest tests/*/test_checkpoint.py

Layout: {job.dump_folder}/{checkpoint.folder}/step-{N}/ holds DCP shards of the model,
optimizer, LR schedule and train state (step, policy version, reward-error count, every rank's
torch/python/numpy RNG state), plus manifest.json (the run facts a resume checks, and each
file's size). A save writes step-{N}.tmp/, and only once the whole save is complete does rank
0 write the manifest and rename the folder to step-{N}: a run killed mid-save leaves a .tmp
folder that the next start removes, never a torn step-{N}. A step-{N} whose manifest is missing
or whose files differ in size from it (truncated, copied half-way) is skipped with a warning.

Prompts and sampling seeds are functions of (job.seed, step, rank), so restoring the step
restores the prompt cursor and the generator's sampling state.
"""

import json
import os
import pickle
import random
import re
import shutil
import warnings
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor
from torchtitan.components.checkpoint import ModelWrapper

from torchtitan_rl import console, platform
from torchtitan_rl.config import (
    CheckpointSection,
    ConfigError,
    JobConfig,
)
from torchtitan_rl.errors import StopRun
from torchtitan_rl.trainer.lora import is_lora_key

MANIFEST = "manifest.json"
# Room a save keeps beyond `save_bytes`: DCP's metadata, the manifest, and what the estimate
# leaves out (LR schedule, train state, RNG states: kilobytes).
SAVE_MARGIN_BYTES = 64 * 2**20
_NON_MODEL = ("optimizer", "lr_scheduler", "train_state")
_STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(StopRun):
    """A save failed or could not fit (e.g. the disk is full); earlier checkpoints are
    untouched."""


def save_bytes(trainer) -> int:
    """This rank's share of a checkpoint, at most: each trained parameter's local shard and
    AdamW's two moments of it (3x its bytes). Frozen weights (LoRA's base) are not saved."""
    total = 0
    for param in trainer.named_parameters().values():
        if param.requires_grad:
            local = param.to_local() if isinstance(param, DTensor) else param
            total += 3 * local.nbytes
    return total


def _free_bytes(path: Path) -> int:
    """Free bytes on the file system that holds `path` (or, before it exists, its parent's)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def _reason(error: BaseException) -> str:
    """One line for a failed save: the first rank's own error, not DCP's multi-line report."""
    if isinstance(error, CheckpointException) and error.failures:
        rank, failure = next(iter(error.failures.items()))
        cause = failure[0] if isinstance(failure, tuple) else failure
        return f"rank {rank}: {_reason(cause)}"
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def _unreadable(error: BaseException) -> str | None:
    """Why DCP could not read a checkpoint's files (a byte-damaged .metadata or .distcp), or
    None when it failed otherwise."""
    if isinstance(error, CheckpointException):
        causes = [f[0] if isinstance(f, tuple) else f for f in error.failures.values()]
        return next(filter(None, map(_unreadable, causes)), None)
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    if isinstance(error, AssertionError) and "metadata read failed" in text:
        return f".metadata does not load: {text.split('read failed: ')[1].split(';')[0]}"
    if isinstance(error, (pickle.UnpicklingError, EOFError, OSError)):
        return f"a .distcp file does not load: {type(error).__name__}: {text.split('. ')[0]}"
    return None


def warn(message: str) -> None:
    console.warn(f"warning: {message}")


@dataclass(slots=True)
class TrainState:
    """The loop's own counters and this rank's random generators (a DCP Stateful)."""

    step: int = 0
    policy_version: int = 0
    reward_errors: int = 0
    """The run's reward errors so far, every rank's (reward/errors): one value, which DCP saves
    once for all ranks; a resumed run carries it on in one counting rank."""
    with_rng: bool = True
    """False while loading a checkpoint saved by another world size: no rank owns its RNGs."""
    cursors: dict | None = None
    """Continuous placement: for each generator, the groups trained on (continuous.Cursor as
    (below, above)); None in the other placements."""

    def state_dict(self) -> dict:
        state = {
            "step": self.step,
            "policy_version": self.policy_version,
            "reward_errors": self.reward_errors,
        }
        if self.cursors is not None:  # the same on every trainer rank; one leaf, pickled
            state["cursors"] = pickle.dumps(self.cursors)
        if self.with_rng:
            # Keys differ per rank, so DCP keeps every rank's generators, not only rank 0's.
            state[f"rng_rank{dist.get_rank()}"] = {
                "torch": torch.get_rng_state(),
                "python": pickle.dumps(random.getstate()),
                "numpy": pickle.dumps(np.random.get_state()),
            }
        return state

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]
        self.policy_version = state["policy_version"]
        self.reward_errors = state["reward_errors"]
        if self.cursors is not None:
            self.cursors = pickle.loads(state["cursors"])
        rng = state.get(f"rng_rank{dist.get_rank()}")
        if rng is not None:
            torch.set_rng_state(rng["torch"])
            random.setstate(pickle.loads(rng["python"]))
            np.random.set_state(pickle.loads(rng["numpy"]))


def _flavor(flavor: str) -> str:
    """A flavor as a checkpoint records it: a derived one (auto:<folder>) with its folder's
    absolute path, so that a resume naming the folder another way is the same run."""
    from torchtitan_rl.models.from_hf import checkpoint_of, derived_flavor

    folder = checkpoint_of(flavor)
    return flavor if folder is None else derived_flavor(_absolute(folder))


def run_facts(config: JobConfig) -> dict:
    """What a checkpoint records about its run, and a resume compares."""
    return {
        "model": {"name": config.model.name, "flavor": _flavor(config.model.flavor)},
        "hf_checkpoint": _absolute(config.model.hf_checkpoint),
        "tokenizer_dir": _absolute(config.model.tokenizer_dir),
        "seed": config.job.seed,
        "prompts_per_step": config.training.prompts_per_step,
        "lora": asdict(config.lora) if config.lora.enable else None,
    }


@dataclass(slots=True)
class PendingSave:
    step: int
    tmp: Path
    final: Path
    future: Future | None = None
    published: bool = False


def _absolute(path: str | None) -> str | None:
    return None if path is None else str(Path(path).resolve())


def invalid_reason(path: Path) -> str | None:
    """Why the checkpoint folder `path` cannot be loaded, or None when it is complete."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        return f"no {MANIFEST} (a save that did not finish)"
    except (OSError, ValueError) as e:
        return f"unreadable {MANIFEST}: {e}"
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files", {}), dict):
        return f"{MANIFEST} is not one this program writes"
    for name, size in manifest.get("files", {}).items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != size:
            return f"{name} has {file.stat().st_size} bytes, the manifest says {size}"
    if not manifest.get("files"):
        return f"{MANIFEST} lists no files"
    return None


def read_manifest(path: Path) -> dict:
    return json.loads((Path(path) / MANIFEST).read_text())


class Checkpointer:
    """Saves and restores one placement's trainer state under {dump_folder}/{checkpoint.folder}.

    `find()` runs first, before anything is built, so a wrong folder fails in a second;
    `attach()` then hands over the trainer and the train state that `load()`/`save()` use.
    """

    def __init__(
        self,
        section: CheckpointSection,
        dump_folder: str,
        facts: dict,
        group: dist.ProcessGroup | None = None,
        async_group: dist.ProcessGroup | None = None,
    ):
        """`facts`: run_facts() of the run, recorded in every manifest and checked on resume.
        `group`: the ranks that hold the trainer (default: the world); `async_group`: a gloo
        group over them for background saves (made here when the world trains)."""
        self.section = section
        self.enabled = section.enable
        self.folder = Path(dump_folder) / section.folder
        self.facts = {**facts, "world_size": dist.get_world_size(group)}
        self.group = group
        self.rank = dist.get_rank(group)
        self.pending: PendingSave | None = None
        self.async_group = async_group
        if self.enabled and section.async_mode == "async" and group is None:
            self.async_group = dist.new_group(backend="gloo")

    def attach(self, trainer, state: TrainState) -> None:
        self.trainer = trainer
        self.state = state
        # Built only when used: it reads the model's state dict (a collective under FSDP).
        self.model_state = ModelWrapper(trainer.model) if self.enabled else None

    def _states(self) -> dict:
        states = {
            "optimizer": self.trainer.optimizers,
            "lr_scheduler": self.trainer.lr_schedulers,
            "train_state": self.state,
        }
        # Model keys at the top level, as torchtitan's checkpoints keep them.
        model_state = self.model_state.state_dict()
        if self.trainer.lora is not None:
            # LoRA: the frozen weights are model.hf_checkpoint's (the trainer loads them at
            # start, resumed or not), so a checkpoint holds the adapters alone.
            model_state = {k: v for k, v in model_state.items() if is_lora_key(k)}
        states.update(model_state)
        return states

    # ---- finding checkpoints ----

    def complete_steps(self) -> list[int]:
        """Steps of the complete checkpoints in the folder, oldest first; warns about others."""
        steps = []
        if not self.folder.is_dir():
            return steps
        for path in sorted(self.folder.iterdir()):
            match = _STEP_DIR.match(path.name)
            if not match or not path.is_dir():
                continue
            reason = invalid_reason(path)
            if reason is not None:
                if self.rank == 0:
                    warn(f"skipping checkpoint {path}: {reason}")
                continue
            steps.append(int(match.group(1)))
        return sorted(steps)

    def remove_interrupted_saves(self) -> None:
        if self.rank == 0 and self.folder.is_dir():
            for path in self.folder.glob("step-*.tmp"):
                warn(f"removing {path}: a save that was interrupted")
                shutil.rmtree(path, ignore_errors=True)
        dist.barrier(group=self.group)

    def find(self) -> Path | None:
        """The checkpoint to resume from: checkpoint.resume_from, else the latest complete one;
        None for a fresh start. Checks it belongs to this run's model."""
        if not self.enabled:
            return None
        self.remove_interrupted_saves()
        steps = self.complete_steps()
        wanted = self.section.resume_from
        if wanted is not None and wanted not in steps:
            step = self.folder / f"step-{wanted}"
            why = f"{step} is incomplete: {invalid_reason(step)}" if step.is_dir() else ""
            raise ConfigError(
                f"checkpoint.resume_from = {wanted}: "
                f"{why or f'no complete checkpoint of that step in {self.folder}'} (complete: "
                f"{steps or 'none'}); pick one of them or unset it"
            )
        if not steps:
            return None
        path = self.folder / f"step-{wanted if wanted is not None else steps[-1]}"
        self.check_same_run(read_manifest(path), path)
        return path

    # ---- resume ----

    def load(self, path: Path) -> int:
        """Restore model, optimizer, LR schedule and train state from `path`; returns the step."""
        states = self._states()
        with warnings.catch_warnings():
            # torchtitan's LR container reads the LR while loading; torch warns about it.
            warnings.filterwarnings("ignore", message="To get the last learning rate")
            try:
                dcp.load(states, checkpoint_id=str(path), process_group=self.group)
            except CheckpointException as e:
                if (reason := _unreadable(e)) is None:
                    raise  # not damaged files: a state that does not fit, a bug
                raise ConfigError(
                    f"{path} is damaged ({reason}) though its files have the sizes its manifest "
                    "records: delete it to resume from the checkpoint before it, or pick one "
                    "with checkpoint.resume_from"
                ) from None
        self.state.with_rng = True
        # Through the modules' load hooks (e.g. torchtitan's fused-QKV split in reverse).
        self.model_state.load_state_dict({k: v for k, v in states.items() if k not in _NON_MODEL})
        self.trainer.step = self.state.step
        if self.rank == 0:
            console.say(f"resumed from {path}")
        return self.state.step

    def check_same_run(self, manifest: dict, path: Path) -> None:
        saved, ours = manifest["facts"], self.facts
        if saved["model"] != ours["model"]:
            raise ConfigError(
                f"{path} holds a checkpoint of model {saved['model']['name']}/"
                f"{saved['model']['flavor']}, but model.name/model.flavor are "
                f"{ours['model']['name']}/{ours['model']['flavor']}: use another "
                "job.dump_folder, or the model the checkpoint was saved from"
            )
        if saved.get("lora") != ours["lora"]:
            raise ConfigError(
                f"{path} holds a checkpoint with lora = {saved.get('lora')}, but this run has "
                f"lora = {ours['lora']}: use another job.dump_folder, or the [lora] section the "
                "checkpoint was saved with"
            )
        if saved["seed"] != ours["seed"] or saved["prompts_per_step"] != ours["prompts_per_step"]:
            warn(
                f"{path} was saved with job.seed = {saved['seed']}, training.prompts_per_step "
                f"= {saved['prompts_per_step']}; this run's differ, so the prompt sequence "
                "after the resume differs from the original run's"
            )
        if saved["world_size"] != ours["world_size"]:
            # DCP reshards model and optimizer; per-rank random generators have no new owner.
            self.state.with_rng = False
            if self.rank == 0:
                warn(
                    f"{path} was saved by {saved['world_size']} ranks, this run has "
                    f"{ours['world_size']}: weights and optimizer are resharded, RNG states "
                    "are not restored"
                )

    # ---- save ----

    def should_save(self, step: int, last: bool) -> bool:
        return self.enabled and (last or step % self.section.interval == 0)

    def save(self, step: int) -> None:
        """Write step-{step}; synchronous, or in the background (checkpoint.async_mode).
        Raises CheckpointError, before writing anything, when it cannot fit (`check_room`)."""
        self.wait()
        self.check_room(step)
        save = PendingSave(step, self.folder / f"step-{step}.tmp", self.folder / f"step-{step}")
        if self.rank == 0:
            shutil.rmtree(save.tmp, ignore_errors=True)
            save.tmp.mkdir(parents=True)
        dist.barrier(group=self.group)
        states = self._states()
        if self.async_group is not None:
            save.future = dcp.async_save(
                states, checkpoint_id=str(save.tmp), process_group=self.async_group
            )
            self.pending = save
            return
        try:
            dcp.save(states, checkpoint_id=str(save.tmp), process_group=self.group)
        except (OSError, CheckpointException) as e:  # DCP's wraps each rank's error (a
            # BaseException, not an Exception); OSError: disk full, quota, permissions
            shutil.rmtree(save.tmp, ignore_errors=True)
            raise CheckpointError(
                f"step {step}: saving the checkpoint to {save.tmp} failed ({_reason(e)}); the "
                f"latest complete checkpoint is still {self._latest()}: free space and restart "
                "to resume"
            ) from e
        dist.barrier(group=self.group)  # every rank's files are written
        self._publish(save)
        dist.barrier(group=self.group)

    def check_room(self, step: int) -> None:
        """Refuse a save that cannot fit, before any byte of it is written: every rank's
        `save_bytes` summed, plus SAVE_MARGIN_BYTES, against the least free space a rank sees
        where the checkpoint goes. Every rank of the group decides alike (two all-reduces)."""
        needed = torch.tensor([save_bytes(self.trainer)], dtype=torch.int64)
        free = torch.tensor([_free_bytes(self.folder)], dtype=torch.int64)
        platform.all_reduce_host(needed, group=self.group)
        platform.all_reduce_host(free, op=dist.ReduceOp.MIN, group=self.group)
        needed_bytes = int(needed) + SAVE_MARGIN_BYTES
        if int(free) < needed_bytes:
            raise CheckpointError(
                f"step {step}: the checkpoint needs about {needed_bytes / 2**20:.0f} MiB but "
                f"{self.folder} has {int(free) / 2**20:.0f} MiB free, so nothing was written; "
                f"the latest complete checkpoint is still {self._latest()}: free space and "
                "restart to resume"
            )

    def _latest(self) -> str:
        steps = self.complete_steps()
        return f"step-{steps[-1]}" if steps else "none"

    def poll(self) -> None:
        """Publish a finished background save as soon as it is done. Rank 0 alone: its save
        ends after every rank's (DCP's closing collective), and it alone renames."""
        save = self.pending
        if save is not None and self.rank == 0 and not save.published and save.future.done():
            save.future.result()
            self._publish(save)

    def wait(self) -> None:
        """Finish a background save on every rank (every rank calls it at the same point)."""
        save, self.pending = self.pending, None
        if save is None:
            return
        save.future.result()
        dist.barrier(group=self.group)
        self._publish(save)
        dist.barrier(group=self.group)

    def _publish(self, save: "PendingSave") -> None:
        """Rank 0: manifest (written last, atomically), rename into place, drop old ones."""
        if self.rank != 0 or save.published:
            return
        save.published = True
        tmp, final, step = save.tmp, save.final, save.step
        files = {
            str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()
        }
        manifest = {"step": step, "facts": self.facts, "files": files}
        partial = tmp / f"{MANIFEST}.partial"
        partial.write_text(json.dumps(manifest, indent=1) + "\n")
        os.replace(partial, tmp / MANIFEST)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(self.folder)
        keep = self.section.keep_latest_k
        if keep:
            for old in self.complete_steps()[:-keep]:
                shutil.rmtree(self.folder / f"step-{old}", ignore_errors=True)

    def close(self) -> None:
        self.wait()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
