"""Draw a run's curves from its metrics.jsonl: reward, length, held-out accuracy, KL, entropy,
logprob diff, time.

    .venv/bin/python scripts/plot_metrics.py outputs/debug_cpu/metrics.jsonl -o curves.png

One panel per quantity; a quantity the run did not log (KL without a KL penalty) is skipped.
A mixture's sources (task.sources) get a curve each beside the overall one, from the figures
named <key>/<source>.
"""

import argparse
import json
from pathlib import Path

# (metrics.jsonl key, panel title, log scale)
PANELS = [
    ("reward/mean", "mean reward", False),
    ("response_length/mean", "mean response length (tokens)", False),
    ("eval/accuracy", "held-out accuracy", False),
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
        curves = [(key, "all")] + [(f"{key}/{source}", source) for source in sources(rows, key)]
        for name, label in curves:
            points = [(row["step"], row[name]) for row in rows if name in row]
            ax.plot(
                [s for s, _ in points], [v for _, v in points], marker=".", linewidth=1, label=label
            )
        values = [row[key] for row in rows if key in row]
        if log_scale and all(v > 0 for v in values):
            ax.set_yscale("log")
        if len(curves) > 1:
            ax.legend(fontsize=7)
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return [
        name for key, _, _ in panels for name in [key, *(f"{key}/{s}" for s in sources(rows, key))]
    ]


def sources(rows: list[dict], key: str) -> list[str]:
    """The sources with a figure of their own for `key` ("<key>/<source>"), in name order."""
    prefix = f"{key}/"
    return sorted({k[len(prefix) :] for row in rows for k in row if k.startswith(prefix)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("metrics", type=Path, help="a run's metrics.jsonl")
    parser.add_argument("-o", "--out", type=Path, default=Path("curves.png"))
    args = parser.parse_args()
    drawn = plot(args.metrics, args.out)
    print(f"wrote {args.out} ({', '.join(drawn)})")


if __name__ == "__main__":
    main()
