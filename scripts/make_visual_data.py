"""Write the vision demo's dataset: small PNGs drawn with PIL, each with a question whose answer
is a digit or a word, as train and held-out JSONL rows of chat messages.

    .venv/bin/python scripts/make_visual_data.py --out data/visual

Three kinds of question, each answer with equal odds; `--kinds` picks which (equal odds between
them), and the demo's data is the colour question alone:

    how many dots?                                          1 to 4 dots of one colour
    what colour is the shape: red, green, blue or yellow?   one circle, square or triangle
    which bar is taller, left or right?                     two bars standing on the bottom

A row is one user message of OpenAI-style content parts and its answer:

    {"messages": [{"role": "user", "content": [{"type": "image", "image":
    "images/train_00012.png"}, {"type": "text", "text": "how many dots?"}]}], "answer": "3"}

An image's path is relative to the folder of the JSONL file that names it: "images/..." in
data/visual/train.jsonl is data/visual/images/.... Each side of an image is 28, 56 or 84 pixels
(nine sizes and aspect ratios, 1 to 9 tokens): whole 28-pixel cells, which the processor's
smart_resize keeps, so the model sees the pixels as drawn. Nothing is anti-aliased: a pixel is
the white background or a PALETTE colour, which tests/unit/test_visual_data.py reads back.

No held-out row has a training twin (the same question about the same pixels): held-out rows
are drawn first, from their own stream, and no row repeats one drawn before it. Text keeps to
the tiny tokenizer's alphabet (lowercase: scripts/make_tiny_checkpoint.py's ALPHABET) and each
word question names its choices, which a tiny model can learn to copy. Answers are words, which
math_reward scores 0: rewards are exact matches,
`task.reward_fn = "torchtitan_rl.tasks.rewards:exact_match_reward"`. The same seed gives the
same files.
"""

import argparse
import hashlib
import json
import random
from pathlib import Path

from PIL import Image, ImageDraw

PALETTE = {
    "red": (220, 30, 30),
    "green": (30, 160, 50),
    "blue": (30, 70, 220),
    "yellow": (240, 200, 20),
}
BACKGROUND = (255, 255, 255)
SIDES = (28, 56, 84)  # whole cells of patch_size * merge_size = 28 pixels
TRAIN_ROWS, EVAL_ROWS, SFT_ROWS = 2000, 200, 2000

COUNT = "how many dots?"
COLOUR = "what colour is the shape: red, green, blue or yellow?"
BARS = "which bar is taller, left or right?"


def dots(rng: random.Random, width: int, height: int) -> tuple[Image.Image, str]:
    """1 to 4 discs of one colour, at least 3 pixels of background apart."""
    count, colour = rng.randint(1, 4), PALETTE[rng.choice(list(PALETTE))]
    r = rng.randint(3, min(width, height) // 8)
    centres: list[tuple[int, int]] = []
    tries = 0
    while len(centres) < count:  # rejection sampling
        if tries == 100:  # the first discs left no room: start over
            centres, tries = [], 0
        tries += 1
        x, y = rng.randint(r + 1, width - r - 2), rng.randint(r + 1, height - r - 2)
        if all((x - a) ** 2 + (y - b) ** 2 >= (2 * r + 3) ** 2 for a, b in centres):
            centres.append((x, y))
    image = Image.new("RGB", (width, height), BACKGROUND)
    pen = ImageDraw.Draw(image)
    for x, y in centres:
        pen.ellipse([x - r, y - r, x + r, y + r], fill=colour)
    return image, str(count)


def shape(rng: random.Random, width: int, height: int) -> tuple[Image.Image, str]:
    """One circle, square or triangle in a PALETTE colour; the answer is the colour's name."""
    name = rng.choice(list(PALETTE))
    side = rng.randint(min(width, height) // 3, min(width, height) - 4)
    x, y = rng.randint(1, width - side - 1), rng.randint(1, height - side - 1)
    image = Image.new("RGB", (width, height), BACKGROUND)
    pen = ImageDraw.Draw(image)
    kind = rng.choice(("circle", "square", "triangle"))
    box = [x, y, x + side - 1, y + side - 1]
    if kind == "circle":
        pen.ellipse(box, fill=PALETTE[name])
    elif kind == "square":
        pen.rectangle(box, fill=PALETTE[name])
    else:
        pen.polygon(
            [(x, y + side - 1), (x + side - 1, y + side - 1), (x + side // 2, y)],
            fill=PALETTE[name],
        )
    return image, name


def bars(rng: random.Random, width: int, height: int) -> tuple[Image.Image, str]:
    """Two bars of one colour on the bottom edge, one in each half, the taller one at least a
    quarter of the image's height (and 4 pixels) taller."""
    colour = PALETTE[rng.choice(list(PALETTE))]
    gap = max(4, height // 4)
    short = rng.randint(3, height - 2 - gap)
    tall = rng.randint(short + gap, height - 2)
    taller = rng.choice(("left", "right"))
    heights = {"left": tall, "right": short} if taller == "left" else {"left": short, "right": tall}
    bar = rng.randint(4, width // 4)
    image = Image.new("RGB", (width, height), BACKGROUND)
    pen = ImageDraw.Draw(image)
    for side, lowest in (("left", 1), ("right", width // 2 + 1)):
        x = rng.randint(lowest, lowest + width // 2 - bar - 2)
        pen.rectangle([x, height - heights[side], x + bar - 1, height - 1], fill=colour)
    return image, taller


QUESTIONS = {COUNT: dots, COLOUR: shape, BARS: bars}
KINDS = {"dots": COUNT, "colour": COLOUR, "bars": BARS}
DEMO_KINDS = ("colour",)
"""The demo's questions. At the tiny model's size, with its vision tower random, the colour
question is learned within the demo's minutes (held-out 0.565 after its 600 SFT steps, chance
0.25); the three kinds mixed are not (each at chance after 600)."""


def draw(rng: random.Random, kinds: tuple[str, ...] = DEMO_KINDS) -> tuple[str, Image.Image, str]:
    """(question, image, answer) of a random one of `kinds` (KINDS' keys) and a random size."""
    question = rng.choice([KINDS[kind] for kind in kinds])
    image, answer = QUESTIONS[question](rng, rng.choice(SIDES), rng.choice(SIDES))
    return question, image, answer


def twin_key(question: str, image: Image.Image) -> str:
    """Equal for two rows exactly when they ask the same question about the same pixels."""
    digest = hashlib.sha256(f"{question}\n{image.size}\n".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


def split(
    seed: int = 0,
    train_rows: int = TRAIN_ROWS,
    eval_rows: int = EVAL_ROWS,
    kinds: tuple[str, ...] = DEMO_KINDS,
) -> dict[str, list[tuple[str, Image.Image, str]]]:
    """{"eval": ..., "train": ...} lists of (question, image, answer), none a twin of another.
    The held-out rows come first, from their own stream, so they do not change with
    `train_rows`."""
    seen: set[str] = set()
    out = {}
    for name, rows in (("eval", eval_rows), ("train", train_rows)):
        rng, out[name] = random.Random(f"{seed}/{name}"), []
        while len(out[name]) < rows:
            question, image, answer = draw(rng, kinds)
            key = twin_key(question, image)
            if key not in seen:
                seen.add(key)
                out[name].append((question, image, answer))
    return out


def row(image_path: str, question: str, answer: str) -> dict:
    """A dataset row: one user message (the image, then the question) and the answer."""
    # The image last, next to the answer: the tiny model's sliding layers see 16 tokens back.
    content = [{"type": "text", "text": question}, {"type": "image", "image": image_path}]
    return {"messages": [{"role": "user", "content": content}], "answer": answer}


def demonstration(image_path: str, question: str, answer: str) -> dict:
    """An SFT row: the dataset row's message, then the assistant's answer."""
    messages = row(image_path, question, answer)["messages"]
    return {"messages": [*messages, {"role": "assistant", "content": answer}]}


def write(
    out: Path,
    seed: int = 0,
    train_rows: int = TRAIN_ROWS,
    eval_rows: int = EVAL_ROWS,
    sft_rows: int = SFT_ROWS,
    kinds: tuple[str, ...] = DEMO_KINDS,
):
    """train.jsonl, eval.jsonl and images/{train,eval}_NNNNN.png under `out`; sft.jsonl, the
    first `sft_rows` train rows as demonstrations (the SFT warm start's)."""
    (out / "images").mkdir(parents=True, exist_ok=True)
    for name, examples in split(seed, train_rows, eval_rows, kinds).items():
        lines, shown = [], []
        for i, (question, image, answer) in enumerate(examples):
            path = f"images/{name}_{i:05d}.png"
            image.save(out / path, format="PNG")
            lines.append(json.dumps(row(path, question, answer)) + "\n")
            if name == "train" and i < sft_rows:
                shown.append(json.dumps(demonstration(path, question, answer)) + "\n")
        (out / f"{name}.jsonl").write_text("".join(lines))
        if name == "train":
            (out / "sft.jsonl").write_text("".join(shown))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("data/visual"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train-rows", type=int, default=TRAIN_ROWS)
    parser.add_argument("--eval-rows", type=int, default=EVAL_ROWS)
    parser.add_argument("--sft-rows", type=int, default=SFT_ROWS)
    parser.add_argument(
        "--kinds", default=",".join(DEMO_KINDS), help=f"comma-separated, of {', '.join(KINDS)}"
    )
    args = parser.parse_args()
    kinds = tuple(args.kinds.split(","))
    if not set(kinds) <= set(KINDS):
        parser.error(f"--kinds {args.kinds}: each must be one of {', '.join(KINDS)}")
    write(args.out, args.seed, args.train_rows, args.eval_rows, args.sft_rows, kinds)
    print(f"wrote {args.out}: {args.train_rows} train rows, {args.eval_rows} eval rows")


if __name__ == "__main__":
    main()
