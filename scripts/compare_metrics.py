"""Compare two runs' metrics.jsonl row by row, timing fields apart: what a refactor must not
change. Prints one JSON line: rows compared, fields only in one run, and every differing
non-timing value (empty when the runs agree); exits 1 when any differs.

    .venv/bin/python scripts/compare_metrics.py outputs/before/metrics.jsonl \
        outputs/after/metrics.jsonl

Timing fields: metrics.TIMING_METRICS (time/*, throughput/*, weight_sync/gb_per_s). Rows are
matched by (step, kind: train or eval, the evaluated policy version).
"""

import argparse
import json
import sys
from pathlib import Path

from torchtitan_rl.metrics import TIMING_METRICS


def rows(path: Path) -> dict[tuple, dict]:
    keyed = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        kind = "eval" if any(k.startswith("eval/") for k in row) else "train"
        key = (row["step"], kind, row.get("eval/policy_version", -1))
        keyed[key] = {k: v for k, v in row.items() if not k.startswith(TIMING_METRICS)}
    return keyed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    args = parser.parse_args()
    before, after = rows(args.before), rows(args.after)
    only = sorted(set(before) ^ set(after))
    new_fields, lost_fields, differing = set(), set(), []
    for key in sorted(set(before) & set(after)):
        a, b = before[key], after[key]
        lost_fields |= set(a) - set(b)
        new_fields |= set(b) - set(a)
        differing += [(key, k, a[k], b[k]) for k in sorted(set(a) & set(b)) if a[k] != b[k]]
    result = {
        "rows": len(set(before) & set(after)),
        "rows_in_one_run_only": only,
        "fields_only_before": sorted(lost_fields),
        "fields_only_after": sorted(new_fields),
        "differing": differing[:20],
        "differing_count": len(differing),
    }
    print(json.dumps(result))
    return int(bool(differing or only or lost_fields))


if __name__ == "__main__":
    sys.exit(main())
