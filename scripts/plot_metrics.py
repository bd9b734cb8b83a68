"""Draw a run's curves from its metrics.jsonl: reward, length, KL, entropy, logprob diff, time.

    .venv/bin/python scripts/plot_metrics.py outputs/debug_cpu/metrics.jsonl -o curves.png

One panel per quantity; a quantity the run did not log (KL without a KL penalty) is skipped.
"""

import argparse
import json
from pathlib import Path

# (metrics.jsonl key, panel title, log scale)
PANELS = [
    ("reward/mean", "mean reward", False),
    ("response_length/mean", "mean response length (tokens)", False),
    ("kl", "KL to the reference", False),
    ("entropy", "entropy", False),
    ("logprob_diff/max", "max |generator - trainer| logprob", True),
    ("time/step_s", "step time (s)", False),
]


def plot(metrics_path: Path, out: Path) -> list[str]:
    """Write the curves of `metrics_path` to `out`; returns the keys drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    if not rows:
        raise SystemExit(f"{metrics_path} has no rows")
    panels = [p for p in PANELS if any(p[0] in row for row in rows)]
    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 2.2 * len(panels)), sharex=True)
    for ax, (key, title, log_scale) in zip(axes, panels, strict=True):
        points = [(row["step"], row[key]) for row in rows if key in row]
        values = [v for _, v in points]
        if log_scale and all(v > 0 for v in values):
            ax.set_yscale("log")
        ax.plot([s for s, _ in points], values, marker=".", linewidth=1)
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return [key for key, _, _ in panels]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("metrics", type=Path, help="a run's metrics.jsonl")
    parser.add_argument("-o", "--out", type=Path, default=Path("curves.png"))
    args = parser.parse_args()
    drawn = plot(args.metrics, args.out)
    print(f"wrote {args.out} ({', '.join(drawn)})")


if __name__ == "__main__":
    main()
