"""What a run leaves behind: the [checkpoint] and [metrics] sections.

    .venv/bin/python -m pytest tests/unit/test_checkpoint.py tests/unit/test_config.py

checkpoint.py reads the first, metrics.py the second; both write under job.dump_folder.
"""

import os
from dataclasses import dataclass
from typing import Literal

from torchtitan_rl.config.errors import require


@dataclass(kw_only=True, slots=True)
class CheckpointSection:
    enable: bool = False
    """Save checkpoints to {job.dump_folder}/{checkpoint.folder}."""
    folder: str = "checkpoints"
    """Checkpoint folder, relative to job.dump_folder."""
    interval: int = 50
    """Save every this many steps."""
    keep_latest_k: int = 2
    """Keep this many newest checkpoints; 0 keeps all."""
    resume_from: int | None = None
    """Resume from this step's checkpoint; None: the latest complete one, if any (a run
    restarted with the same command continues where it stopped)."""
    async_mode: Literal["disabled", "async"] = "disabled"
    """async: training goes on while a background thread writes the checkpoint (DCP
    async_save); the checkpoint is published when the write completes."""
    export_hf_at_end: bool = False
    """At the end, write the policy as an HF safetensors folder to {job.dump_folder}/hf
    (loadable by vLLM and transformers); scripts/export_hf.py does it for any checkpoint."""

    def validate(self) -> None:
        require(
            self.resume_from is None or self.enable,
            f"checkpoint.resume_from = {self.resume_from} needs checkpoint.enable = true",
        )
        require(
            bool(self.folder.strip()) and not os.path.isabs(self.folder),
            f"checkpoint.folder = {self.folder!r}: must be a folder name relative to "
            "job.dump_folder, e.g. 'checkpoints'",
        )
        require(self.interval >= 1, f"checkpoint.interval = {self.interval}: must be >= 1")
        require(
            self.keep_latest_k >= 0,
            f"checkpoint.keep_latest_k = {self.keep_latest_k}: must be >= 0 (0 keeps all)",
        )
        require(
            self.resume_from is None or self.resume_from >= 0,
            f"checkpoint.resume_from = {self.resume_from}: must be a step >= 0",
        )


@dataclass(kw_only=True, slots=True)
class MetricsSection:
    log_interval: int = 1
    """Print a console line every this many steps (metrics.jsonl gets every step)."""
    enable_tensorboard: bool = False
    """Write TensorBoard event files to {job.dump_folder}/tb."""
    enable_wandb: bool = False
    """Log every metric to Weights & Biases (needs `pip install wandb` and `wandb login`, or
    WANDB_MODE=offline); never required. A resumed run continues the same W&B run."""
    wandb_project: str = "torchtitan_rl"
    """The W&B project the run logs to."""
    rollout_log_interval: int = 10
    """Every this many steps, write a few of rank 0's prompts, completions, rewards and
    per-token logprob diffs to rollouts.jsonl; 0 disables."""

    def validate(self) -> None:
        if self.enable_wandb:
            import importlib.util

            require(
                importlib.util.find_spec("wandb") is not None,
                "metrics.enable_wandb = true needs the wandb package: pip install wandb, "
                "or set it false",
            )
        require(self.log_interval >= 1, f"metrics.log_interval = {self.log_interval}: must be >= 1")
        require(
            self.rollout_log_interval >= 0,
            f"metrics.rollout_log_interval = {self.rollout_log_interval}: must be >= 0",
        )
