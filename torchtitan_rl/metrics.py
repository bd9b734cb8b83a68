"""Per-step metrics: metrics.jsonl (rank 0), TensorBoard, a console line, a progress bar,
a reward curve, and sampled rollouts (rollouts.jsonl).

    .venv/bin/python -m pytest tests/test_rl_trainer.py

metrics.jsonl holds one JSON object per step; later tools and benchmarks read its keys (the
contract): step, reward/mean, reward/std, response_length/mean, loss, entropy, clip_fraction,
logprob_diff/max, logprob_diff/mean, policy_version, time/generate_s, time/train_s,
time/weight_sync_s, time/step_s, throughput/generated_tokens_per_s.
"""

import json
import os
import sys
import uuid
from pathlib import Path

CONSOLE_KEYS = (
    ("reward/mean", "reward {:.3f}"),
    ("response_length/mean", "len {:.1f}"),
    ("loss", "loss {:+.4f}"),
    ("entropy", "entropy {:.3f}"),
    ("logprob_diff/max", "lp_diff {:.1e}"),
    ("time/step_s", "{:.2f}s"),
)


class MetricsLogger:
    """Writes metrics on rank 0 only; every other rank's logger does nothing."""

    def __init__(
        self,
        dump_folder: str,
        *,
        enabled: bool,
        total_steps: int,
        log_interval: int,
        tensorboard: bool = False,
        wandb_project: str | None = None,
        run_config: dict | None = None,
        resume_step: int = 0,
    ):
        """`wandb_project`: also log to W&B (`run_config` is the run's config).
        `resume_step` > 0: a resumed run keeps the rows of steps up to it and drops the
        later ones (the run being replaced wrote them after its last checkpoint)."""
        self.enabled = enabled
        self.log_interval = log_interval
        self.path = Path(dump_folder) / "metrics.jsonl"
        self.rollouts_path = Path(dump_folder) / "rollouts.jsonl"
        self.bar = None
        self.tensorboard = None
        self.wandb = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            _keep_rows_until(self.path, resume_step)
            _keep_rows_until(self.rollouts_path, resume_step)
            if tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                self.tensorboard = SummaryWriter(
                    log_dir=str(Path(dump_folder) / "tb"), purge_step=resume_step + 1
                )
            if wandb_project is not None:
                self.wandb = _wandb_run(Path(dump_folder), wandb_project, run_config or {})
            # A bar only where someone watches: not under CI, not into a file.
            if sys.stderr.isatty() and not os.environ.get("CI"):
                from tqdm import tqdm

                self.bar = tqdm(total=total_steps, desc="steps", unit="step")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.tensorboard is not None:
            for key, value in metrics.items():
                self.tensorboard.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}")
        if step % self.log_interval == 0:
            parts = [fmt.format(metrics[key]) for key, fmt in CONSOLE_KEYS if key in metrics]
            line = f"step {step:4d} | " + " | ".join(parts)
            if self.bar is not None:
                self.bar.write(line)
            else:
                print(line, flush=True)

    def log_rollouts(self, step: int, samples: list[dict]) -> None:
        """Append sampled prompts, completions, rewards and per-token logprob diffs."""
        if not self.enabled:
            return
        with self.rollouts_path.open("a") as f:
            f.write(json.dumps({"step": step, "samples": samples}) + "\n")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.enabled:
            plot_reward_curve(self.path, self.path.with_name("reward_curve.png"))


def _wandb_run(dump_folder: Path, project: str, run_config: dict):
    """A W&B run writing under the dump folder; a resumed run continues the same one."""
    import wandb

    id_file = dump_folder / "wandb_run_id"
    run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:8]
    id_file.write_text(run_id + "\n")
    return wandb.init(
        project=project,
        id=run_id,
        resume="allow",
        dir=str(dump_folder),
        name=dump_folder.name,
        config=run_config,
    )


def _keep_rows_until(path: Path, step: int) -> None:
    """Rewrite the JSONL file `path` with only its rows of steps <= `step` (atomically)."""
    rows = []
    if step > 0 and path.is_file():
        for line in path.read_text().splitlines():
            try:
                if json.loads(line)["step"] <= step:
                    rows.append(line + "\n")
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by the kill
    partial = path.with_name(path.name + ".partial")
    partial.write_text("".join(rows))
    os.replace(partial, path)


def plot_reward_curve(metrics_path: Path, out: Path) -> None:
    """Mean reward per step from metrics.jsonl, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in rows], [r["reward/mean"] for r in rows], marker=".")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
