"""The [distill] section: on-policy distillation from a teacher checkpoint.

    .venv/bin/python -m pytest tests/unit/test_distill.py

The student samples; the teacher scores every sampled token; the per-token reverse KL
log pi_student(y_t) - log pi_teacher(y_t) is the signal (docs/distillation.md). Which sources
learn from it is each source's `learn_from` (config/task.py).
"""

import math
import os
from dataclasses import dataclass
from typing import Literal

from torchtitan_rl.config.errors import ConfigError, first_change, require


@dataclass(kw_only=True, slots=True)
class DistillSection:
    teacher_checkpoint: str | None = None
    """HF checkpoint directory of the teacher (config.json + *.safetensors), a model of
    model.name with the student's tokenizer and vocabulary; unset: no teacher."""
    teacher_flavor: str | None = None
    """torchtitan flavor of the teacher (it may be larger than the student), or auto: the
    shape of distill.teacher_checkpoint's config.json. Unset: model.flavor, or auto when
    model.flavor is."""
    coef: float = 1.0
    """Weight of the teacher's signal: the per-token advantage is -coef * (log pi_student -
    log pi_teacher) (mode advantage), or coef * the KL estimate joins the loss (mode loss)."""
    mode: Literal["advantage", "loss"] = "advantage"
    """How the teacher's signal enters. advantage: every sampled token's advantage gains
    -coef * its reverse KL, computed from the generator's logprob (Thinking Machines' on-policy
    distillation; no gradient through the teacher); loss: coef * KL(student || teacher), the
    algorithm.kl_estimator of the current policy against the teacher, joins each token's loss
    (as the reference's KL penalty does)."""

    @property
    def enabled(self) -> bool:
        return self.teacher_checkpoint is not None

    def validate(self) -> None:
        if not self.enabled:
            changed = first_change(self, DistillSection(), "distill")
            if changed is not None:
                raise ConfigError(
                    f"{changed[0]} = {changed[1]!r} does nothing without a teacher: set "
                    "distill.teacher_checkpoint to an HF checkpoint directory, or remove it"
                )
            return
        path = self.teacher_checkpoint
        require(
            os.path.isdir(path),
            f"distill.teacher_checkpoint = {path!r}: no such directory; point it at a local "
            "HF checkpoint directory (e.g. an RL run's export, {job.dump_folder}/hf)",
        )
        require(
            os.path.isfile(os.path.join(path, "config.json")),
            f"distill.teacher_checkpoint = {path!r} has no config.json: point it at an HF "
            "checkpoint directory",
        )
        require(
            math.isfinite(self.coef) and self.coef > 0,
            f"distill.coef = {self.coef}: must be > 0 (e.g. 1.0); to train on rewards alone, "
            "remove the [distill] section",
        )
