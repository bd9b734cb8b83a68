"""Per-step metrics: metrics.jsonl (rank 0), TensorBoard, a console line, a progress bar,
a reward curve, sampled rollouts (rollouts.jsonl), and the summary a finished run ends with.

    .venv/bin/python -m pytest tests/*/test_rl_trainer.py

metrics.jsonl holds one JSON object per step; later tools and benchmarks read its keys (the
contract): step, reward/mean, reward/std, response_length/mean, loss, entropy, clip_fraction,
logprob_diff/max, logprob_diff/mean, policy_version, time/generate_s, time/train_s,
time/weight_sync_s, weight_sync/bytes, time/step_s, throughput/generated_tokens_per_s.
"""

import json
import os
import uuid
from dataclasses import asdict
from pathlib import Path

from torchtitan_rl import console

# Metrics that measure the machine, not the run (prefixes): every other metric of a run is a
# function of its config and seed (a resumed run's, a refactor's: scripts/compare_metrics.py).
TIMING_METRICS = ("time/", "throughput/", "weight_sync/gb_per_s")

# An RL step's loss is ~0 by construction (group-normalized advantages): its line shows what
# moves instead, the gradient's norm, the KL to the reference (with a KL penalty) and the clip
# fraction (with several updates per batch); an SFT step's line shows its loss (docs/rl_loop.md).
CONSOLE_KEYS = (
    ("reward/mean", "reward {:.3f}"),
    ("response_length/mean", "len {:.1f}"),
    ("loss", "loss {:.4f}"),
    ("grad_norm", "grad {:.3g}"),
    ("kl", "kl {:.2e}"),
    ("clip_fraction", "clip {:.3f}"),
    ("entropy", "entropy {:.3f}"),
    ("logprob_diff/max", "lp_diff {:.1e}"),
    ("throughput/generated_tokens_per_s", "gen {:.0f} tok/s"),
    ("throughput/trained_tokens_per_s", "train {:.0f} tok/s"),
    ("time/step_s", "{:.2f}s"),
)


# RL evaluations report accuracy, SFT's the held-out loss and its greedy samples' exact matches.
EVAL_CONSOLE_KEYS = (
    ("eval/accuracy", "accuracy {:.3f}"),
    ("eval/loss", "loss {:.4f}"),
    ("eval/samples_exact_match", "samples exact {:.2f}"),
    ("eval/response_length", "len {:.1f}"),
    ("eval/policy_version", "policy version {:.0f}"),
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
        self.eval_path = Path(dump_folder) / "eval.jsonl"
        self.bar = None
        self.tensorboard = None
        self.wandb = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            _keep_rows_until(self.path, resume_step)
            _keep_rows_until(self.rollouts_path, resume_step)
            _keep_rows_until(self.eval_path, resume_step)
            if tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                self.tensorboard = SummaryWriter(
                    log_dir=str(Path(dump_folder) / "tb"), purge_step=resume_step + 1
                )
            if wandb_project is not None:
                self.wandb = _wandb_run(Path(dump_folder), wandb_project, run_config or {})
            # A bar only where someone watches: not under CI, not into a file.
            terminal = console.terminal()
            if terminal.isatty() and not os.environ.get("CI"):
                from tqdm import tqdm

                self.bar = tqdm(total=total_steps, desc="steps", unit="step", file=terminal)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        self._record(step, metrics)
        if self.bar is not None:
            self.bar.update(1)
            if "reward/mean" in metrics:
                self.bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}")
            else:
                self.bar.set_postfix(loss=f"{metrics['loss']:.4f}")
        if step % self.log_interval == 0:
            rl = "reward/mean" in metrics
            parts = [
                fmt.format(metrics[key])
                for key, fmt in CONSOLE_KEYS
                if key in metrics
                and not (rl and key == "loss")
                and not (key == "clip_fraction" and metrics.get("optimizer_steps", 1) <= 1)
            ]
            self._say(f"step {step:4d} | " + " | ".join(parts))

    def log_eval(self, step: int, metrics: dict[str, float], samples: list[dict]) -> None:
        """An evaluation of the policy after `step` (eval/policy_version names the version it
        evaluated): a row of its own in metrics.jsonl, its samples in eval.jsonl, a console
        line."""
        if not self.enabled:
            return
        self._record(step, metrics)
        with self.eval_path.open("a") as f:
            f.write(
                json.dumps({"step": step, **metrics, "samples": samples}, default=_brief) + "\n"
            )
        parts = [fmt.format(metrics[key]) for key, fmt in EVAL_CONSOLE_KEYS if key in metrics]
        passes = [
            f"{k[5:]} {v:.3f}"
            for k, v in metrics.items()
            if k.startswith("eval/pass@") and k.count("/") == 1
        ]
        # A mixture's sources: each one's accuracy on its own eval set.
        sources = [
            f"{k[len('eval/accuracy/') :]} {v:.3f}"
            for k, v in metrics.items()
            if k.startswith("eval/accuracy/")
        ]
        parts[1:1] = passes + sources  # after the accuracy
        self._say(f"eval {step:4d} | " + " | ".join(parts))

    def _record(self, step: int, metrics: dict[str, float]) -> None:
        """A row of metrics.jsonl, and the same values to TensorBoard and W&B."""
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.tensorboard is not None:
            for key, value in metrics.items():
                self.tensorboard.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)

    def _say(self, line: str) -> None:
        if self.bar is not None:
            # The bar steps aside while the line is written, then redraws below it.
            with self.bar.external_write_mode(file=self.bar.fp):
                console.say(line)
        else:
            console.say(line)

    def log_rollouts(self, step: int, samples: list[dict]) -> None:
        """Append sampled prompts, completions, rewards and per-token logprob diffs."""
        if not self.enabled:
            return
        with self.rollouts_path.open("a") as f:
            f.write(json.dumps({"step": step, "samples": samples}, default=_brief) + "\n")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.enabled:
            plot_reward_curve(self.path, self.path.with_name("reward_curve.png"))


def run_metrics(config, *, enabled: bool, resume_step: int) -> MetricsLogger:
    """The MetricsLogger of a run with JobConfig `config` (RL or SFT): its dump folder, steps
    and metrics section; `enabled` on the rank that writes."""
    section = config.metrics
    return MetricsLogger(
        config.job.dump_folder,
        enabled=enabled,
        total_steps=config.training.steps,
        log_interval=section.log_interval,
        tensorboard=section.enable_tensorboard,
        wandb_project=section.wandb_project if section.enable_wandb else None,
        run_config=asdict(config),
        resume_step=resume_step,
    )


def summary(dump_folder: Path, *, wall_s: float, log: Path | None, checkpoints: Path) -> list[str]:
    """The lines a finished run ends with: how far it got, its first and last mean reward, its
    last eval accuracy (if it logged one), and where its outputs are; no rows, no lines."""
    metrics_path = dump_folder / "metrics.jsonl"
    rows = _rows(metrics_path)
    # An RL run's headline is its reward, an SFT run's its loss.
    key = "reward/mean" if any("reward/mean" in row for row in rows) else "loss"
    trained = [row for row in rows if key in row]
    if not trained:
        return []
    first, last = trained[0], trained[-1]
    lines = [
        f"done: trained to step {last['step']} in {wall_s:.0f} s | {key} "
        f"{first[key]:.3f} at step {first['step']} -> {last[key]:.3f} at step {last['step']}"
        + _throughput(trained)
    ]
    for name in ("eval/accuracy", "eval/loss"):
        evaluated = [row for row in rows if name in row]
        if evaluated:
            lines.append(f"{name} {evaluated[-1][name]:.3f} at step {evaluated[-1]['step']}")
    lines.append(f"metrics:     {metrics_path}")
    curve = metrics_path.with_name("reward_curve.png")
    if curve.is_file():
        lines.append(f"reward plot: {curve}")
    plot = f".venv/bin/python scripts/plot_metrics.py {metrics_path} -o {dump_folder}/curves.png"
    lines.append(f"all curves:  {plot}")
    if log is not None:
        others = " (other ranks: run.rank<N>.log)" if any(log.parent.glob("run.rank*.log")) else ""
        lines.append(f"library log: {log}{others}")
    if checkpoints.is_dir() and any(checkpoints.iterdir()):
        lines.append(f"checkpoints: {checkpoints}")
    if (dump_folder / "hf").is_dir():
        lines.append(f"HF export:   {dump_folder / 'hf'}")
    return lines


def _rows(path: Path) -> list[dict]:
    """The rows of a JSONL file (none if it is missing; a line cut short or damaged is
    skipped)."""
    rows = []
    for line in path.read_text(errors="replace").splitlines() if path.is_file() else []:
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


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
        for line in path.read_text(errors="replace").splitlines():  # damaged bytes: skipped
            try:
                if json.loads(line)["step"] <= step:
                    rows.append(line + "\n")
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by the kill
    partial = path.with_name(path.name + ".partial")
    partial.write_text("".join(rows))
    os.replace(partial, path)


def plot_reward_curve(metrics_path: Path, out: Path) -> None:
    """Mean reward per step from metrics.jsonl, and held-out eval accuracy where the run
    evaluated, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = _rows(metrics_path)
    trained = [r for r in rows if "reward/mean" in r]
    evaluated = [r for r in rows if "eval/accuracy" in r]
    if not trained and not evaluated:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(
        [r["step"] for r in trained],
        [r["reward/mean"] for r in trained],
        ".-",
        label="train reward",
    )
    if evaluated:
        steps = [r["step"] for r in evaluated]
        ax.plot(steps, [r["eval/accuracy"] for r in evaluated], "o-", label="eval accuracy")
        ax.legend()
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward / accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def _brief(value) -> str:
    """What JSON cannot hold in a sample's messages, in a few words: an image part's PIL image
    or bytes."""
    if isinstance(value, bytes):
        return f"<image: {len(value)} bytes>"
    if hasattr(value, "size") and hasattr(value, "mode"):  # a PIL image
        return f"<image: {value.size[0]}x{value.size[1]} {value.mode}>"
    return f"<{type(value).__name__}>"


def _throughput(rows: list[dict]) -> str:
    """' | N tokens/s generated, M trained' over a run's steps ('' without the figures)."""
    generated = sum(row.get("generated_tokens", 0.0) for row in rows)
    generate_s = sum(row.get("time/generate_s", 0.0) for row in rows)
    trained = sum(row.get("trained_tokens", 0.0) for row in rows)
    train_s = sum(row.get("time/train_s", 0.0) for row in rows)
    if not (generate_s and train_s and trained):
        return ""
    return f" | {generated / generate_s:.0f} tokens/s generated, {trained / train_s:.0f} trained"
