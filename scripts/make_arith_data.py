"""Write the arithmetic demo's dataset: "max(a,b)=" and "min(a,b)=" over distinct digits a, b,
split into train (JSONL) and held-out test (Parquet) prompts, plus a few SFT demonstrations.

    .venv/bin/python scripts/make_arith_data.py --out data/arith

The answer needs three prompt tokens (the operation and both digits), and every held-out prompt
is unseen in training, so held-out accuracy measures the operation, not recall. Why not sums:
measured on the tiny model with RL alone (docs/data_and_eval.md), single-digit sums
collapse to the most frequent answer or are memorized without reaching held-out pairs, while
max and min generalize. sft.jsonl holds the first SFT_ROWS training rows: demonstrations are
scarce next to prompts with a checkable answer, so the SFT warm start sees few of them and RL
sees every training prompt (docs/sft.md). The same seed gives the same files; they
are small and shipped.
"""

import argparse
import json
import random
from pathlib import Path

OPERATIONS = {"max": max, "min": min}
SFT_ROWS = 24


def rows(operations: list[str]) -> list[dict]:
    """{"prompt": "max(3,7)=", "answer": "7"} for each operation and ordered pair a != b."""
    return [
        {"prompt": f"{name}({a},{b})=", "answer": str(OPERATIONS[name](a, b))}
        for name in operations
        for a in range(10)
        for b in range(10)
        if a != b
    ]


def split(seed: int = 0, held_out: float = 0.2, operations=("max", "min")):
    """The train and test rows: a seeded shuffle, the first `held_out` fraction held out."""
    everything = rows(list(operations))
    random.Random(seed).shuffle(everything)
    cut = round(len(everything) * held_out)
    return everything[cut:], everything[:cut]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("data/arith"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    import pyarrow as pa
    import pyarrow.parquet as pq

    train, test = split(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train))
    (args.out / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train[:SFT_ROWS]))
    pq.write_table(pa.Table.from_pylist(test), args.out / "test.parquet")
    print(
        f"wrote {args.out}: {len(train)} train rows ({SFT_ROWS} of them in sft.jsonl), "
        f"{len(test)} test rows"
    )


if __name__ == "__main__":
    main()
