"""Write the calculator-tool demo's dataset: sums and differences of two 2-digit numbers
("23+58=", "71-46="), split into RL train rows (JSONL), held-out test rows (Parquet) and SFT
traces (chat messages) of which some call the `calc` tool and the others answer directly.

    .venv/bin/python scripts/make_tool_data.py --out data/arith_tools

The tiny model (2 layers) cannot add or subtract 2-digit numbers itself, but it can copy: the
prompt's expression into a tool call, and the tool's result into its answer. So an answer
that uses the tool is right and one that does not is (nearly always) wrong, and RL from the SFT
warm start has a choice to learn. The SFT traces (sft.jsonl) teach both behaviours, half and
half by default (--tool-fraction); a trace with the tool is

    user: 23+58=
    assistant: <tool_call>{"name":"calc","arguments":{"expression":"23+58"}}</tool_call>
    tool: 81
    assistant: 81

(compact JSON: one token per character, ~70 for the call), one without it is the user's
message and the answer. The traces cover the 512 RL training prompts and 1536 more problems
(none held out): with 128-512 traces the SFT model learned the call's format but copied the
expression and the result too unreliably to be rewarded (docs/environments.md).
Held-out test prompts are none of the training or SFT prompts. Prompts and
answers use digits, + and - only (the tiny tokenizer has no uppercase). The same seed gives the
same files; they are small and shipped.
"""

import argparse
import json
import random
from pathlib import Path

TRAIN_ROWS = 512
TEST_ROWS = 64
SFT_ROWS = 2048
TOOL_FRACTION = 0.5


def problems(rng: random.Random, count: int) -> list[dict]:
    """`count` distinct {"prompt": "23+58=", "answer": "81"} rows, a and b in 10..99, + or -."""
    seen, out = set(), []
    while len(out) < count:
        a, b, op = rng.randint(10, 99), rng.randint(10, 99), rng.choice("+-")
        expression = f"{a}{op}{b}"
        if expression in seen:
            continue
        seen.add(expression)
        out.append({"prompt": f"{expression}=", "answer": str(a + b if op == "+" else a - b)})
    return out


def call(expression: str) -> str:
    """The assistant's tool call, in the Hermes format tasks/env.py parses, compact JSON."""
    body = json.dumps(
        {"name": "calc", "arguments": {"expression": expression}}, separators=(",", ":")
    )
    return f"<tool_call>{body}</tool_call>"


def trace(row: dict, tool: bool) -> dict:
    """An SFT row of chat messages answering `row`, through the tool or directly."""
    user = {"role": "user", "content": row["prompt"]}
    answer = {"role": "assistant", "content": row["answer"]}
    if not tool:
        return {"messages": [user, answer]}
    return {
        "messages": [
            user,
            {"role": "assistant", "content": call(row["prompt"].rstrip("="))},
            {"role": "tool", "content": row["answer"]},
            answer,
        ]
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("data/arith_tools"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sft-rows", type=int, default=SFT_ROWS)
    parser.add_argument(
        "--tool-fraction",
        type=float,
        default=TOOL_FRACTION,
        help="share of the SFT traces that call the tool (the others answer directly)",
    )
    args = parser.parse_args()
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(args.seed)
    # Drawn in order, so the test and train rows do not depend on --sft-rows: test, train,
    # then the problems only the SFT traces use (when --sft-rows exceeds the train rows).
    everything = problems(rng, TEST_ROWS + max(TRAIN_ROWS, args.sft_rows))
    test, train = everything[:TEST_ROWS], everything[TEST_ROWS : TEST_ROWS + TRAIN_ROWS]
    sft_rows = everything[TEST_ROWS : TEST_ROWS + args.sft_rows]
    tools = round(len(sft_rows) * args.tool_fraction)
    # Which traces use the tool: a seeded choice, independent of the arithmetic.
    with_tool = set(random.Random(args.seed + 1).sample(range(len(sft_rows)), tools))
    sft = [trace(row, i in with_tool) for i, row in enumerate(sft_rows)]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train))
    (args.out / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sft))
    pq.write_table(pa.Table.from_pylist(test), args.out / "test.parquet")
    print(
        f"wrote {args.out}: {len(train)} train rows, {len(test)} test rows, {len(sft)} SFT "
        f"traces ({tools} with the tool)"
    )


if __name__ == "__main__":
    main()
