"""Write the mixture demo's SFT folder: the arithmetic max/min demonstrations as chat messages
(repeated, so that they weigh beside the calculator traces) next to a link to the calculator
traces, for one SFT run that teaches both sources' formats.

    .venv/bin/python scripts/make_mixture_sft.py --out data/mixture_sft

data/arith/sft.jsonl holds 24 {"prompt", "answer"} demonstrations; data/arith_tools/sft.jsonl
2,048 traces of messages (scripts/make_tool_data.py). An SFT run reads a folder's files
together with one set of keys (task.messages_key), so the demonstrations are rewritten as
messages: user: "max(6,5)=", assistant: "6". The files are small and shipped.
"""

import argparse
import json
from pathlib import Path

REPEAT = 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("data/mixture_sft"))
    parser.add_argument("--demos", type=Path, default=Path("data/arith/sft.jsonl"))
    parser.add_argument("--traces", type=Path, default=Path("data/arith_tools/sft.jsonl"))
    parser.add_argument("--repeat", type=int, default=REPEAT, help="copies of each demonstration")
    args = parser.parse_args()
    rows = [json.loads(line) for line in args.demos.read_text().splitlines() if line.strip()]
    messages = [
        {
            "messages": [
                {"role": "user", "content": r["prompt"]},
                {"role": "assistant", "content": r["answer"]},
            ]
        }
        for r in rows
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    demos = args.out / "minmax.jsonl"
    demos.write_text("".join(json.dumps(m) + "\n" for m in messages * args.repeat))
    link = args.out / "tools.jsonl"
    link.unlink(missing_ok=True)
    link.symlink_to(Path("..") / args.traces.relative_to(args.traces.parents[1]))
    print(f"wrote {demos} ({len(messages) * args.repeat} rows) and {link} -> {link.readlink()}")


if __name__ == "__main__":
    main()
