"""Write the arithmetic demo's dataset: single-digit sums "a+b=" (a + b <= 9), split into train
(JSONL) and held-out test (Parquet) pairs.

    .venv/bin/python scripts/make_arith_data.py --out data/arith

The answer needs both operands (no single prompt token gives it away), and every held-out pair
is unseen in training, so held-out accuracy measures addition, not recall. The same seed gives
the same split; the files are small and shipped in the repo.
"""

import argparse
import json
import random
from pathlib import Path


def pairs() -> list[tuple[int, int]]:
    """Every (a, b) of digits whose sum is one digit: 55 pairs."""
    return [(a, b) for a in range(10) for b in range(10) if a + b <= 9]


def split(seed: int = 0, held_out: int = 15) -> tuple[list[dict], list[dict]]:
    """Rows {"prompt": "a+b=", "answer": "a+b"} of the train and test pairs."""
    everything = pairs()
    random.Random(seed).shuffle(everything)
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in everything]
    return rows[held_out:], rows[:held_out]


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
    pq.write_table(pa.Table.from_pylist(test), args.out / "test.parquet")
    print(f"wrote {args.out}: {len(train)} train rows, {len(test)} test rows")


if __name__ == "__main__":
    main()
