"""Write the arithmetic demo's dataset: "max(a,b)=" and "min(a,b)=" over distinct digits a, b,
split into train (JSONL) and held-out test (Parquet) prompts, plus a few SFT demonstrations.

    .venv/bin/python scripts/make_arith_data.py --out data/arith

The answer needs three prompt tokens (the operation and both digits), and no held-out prompt is
seen in training, nor its argument-swapped twin (the split is by operation and unordered pair),
so held-out accuracy measures the operation, not recall. Why not sums:
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


def split(seed: int = 0, held_out: float = 0.2, operations=("max", "min")):
    """The train and test rows, split by operation and unordered pair of digits: per operation,
    a seeded shuffle of its {a, b} pairs, the first `held_out` fraction held out in both
    argument orders. A held-out `min(9,2)=` has no `min(2,9)=` twin in training, so a model
    that recalls a trained prompt with its arguments swapped (or copies an argument) gets no
    help from it; a split of ordered pairs left 22 of 36 held-out prompts such a twin."""
    rng = random.Random(seed)
    train_units, test_units = [], []
    for name in operations:  # each operation held out alike
        units = [(name, a, b) for a in range(10) for b in range(a + 1, 10)]
        rng.shuffle(units)
        cut = round(len(units) * held_out)
        test_units += units[:cut]
        train_units += units[cut:]

    def prompts(chosen):
        rows = []
        for name, a, b in chosen:
            for x, y in ((a, b), (b, a)):
                rows.append({"prompt": f"{name}({x},{y})=", "answer": str(OPERATIONS[name](x, y))})
        return rows

    train = prompts(train_units)
    rng.shuffle(train)  # sft.jsonl takes the first rows: operations and orders mixed
    return train, prompts(test_units)


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
