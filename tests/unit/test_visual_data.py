"""The vision demo's dataset (scripts/make_visual_data.py) and its reward: each answer read back
from the PNG's pixels, sizes, the split's twins, the seed, the tokenizer's alphabet.

    .venv/bin/python -m pytest tests/unit/test_visual_data.py
"""

import ast
import importlib.util
import json
import string
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from torchtitan_rl.tasks.rewards import exact_match_reward

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("visual", REPO / "scripts" / "make_visual_data.py")
visual = importlib.util.module_from_spec(spec)
spec.loader.exec_module(visual)


def tokenizer_alphabet() -> str:
    """make_tiny_checkpoint.ALPHABET, read from its source: importing the script imports torch
    and the model registry (4 s)."""
    tree = ast.parse((REPO / "scripts" / "make_tiny_checkpoint.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["ALPHABET"]:
            return eval(compile(ast.Expression(node.value), "ALPHABET", "eval"), {"string": string})
    raise AssertionError("scripts/make_tiny_checkpoint.py defines no ALPHABET")


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("visual")
    visual.write(out, seed=0, train_rows=300, eval_rows=100, kinds=tuple(visual.KINDS))
    return out


def test_the_demo_asks_the_colour_question_alone(tmp_path):
    visual.write(tmp_path, seed=0, train_rows=40, eval_rows=10, sft_rows=5)
    rows = read(tmp_path, "train") + read(tmp_path, "eval")
    assert {question for question, _, _ in rows} == {visual.COLOUR}
    assert {answer for _, _, answer in rows} == set(visual.PALETTE)


def read(out: Path, name: str) -> list[tuple[str, np.ndarray, str]]:
    """(question, pixels_HWC, answer) of each row of out/name.jsonl, its image read from the
    path relative to the JSONL file's folder."""
    rows = []
    for line in (out / f"{name}.jsonl").read_text().splitlines():
        row = json.loads(line)
        [message] = row["messages"]
        text_part, image_part = message["content"]
        assert message["role"] == "user" and image_part["type"] == "image"
        assert text_part["type"] == "text" and isinstance(row["answer"], str)
        with Image.open(out / image_part["image"]) as image:
            assert image.mode == "RGB"
            rows.append((text_part["text"], np.asarray(image), row["answer"]))
    return rows


def components(mask_HW: np.ndarray) -> int:
    """The number of 8-connected regions of True pixels."""
    mask, count = mask_HW.copy(), 0
    for start in zip(*np.nonzero(mask), strict=True):
        if not mask[start]:
            continue
        count, stack = count + 1, [start]
        mask[start] = False
        while stack:
            y, x = stack.pop()
            for dy in (-1, 0, 1):
                for dx in (-1, 0, 1):
                    ny, nx = y + dy, x + dx
                    if 0 <= ny < mask.shape[0] and 0 <= nx < mask.shape[1] and mask[ny, nx]:
                        mask[ny, nx] = False
                        stack.append((ny, nx))
    return count


def test_each_answer_is_what_the_image_shows(written):
    """Dots counted as regions, the shape's colour, the bars' heights: read from the PNG."""
    for question, pixels_HWC, answer in read(written, "train") + read(written, "eval"):
        ink_HW = (pixels_HWC != visual.BACKGROUND).any(axis=-1)
        colours = {tuple(int(c) for c in p) for p in pixels_HWC[ink_HW]}
        assert len(colours) == 1 and colours <= set(visual.PALETTE.values())  # no anti-aliasing
        if question == visual.COUNT:
            assert answer in "1234" and components(ink_HW) == int(answer)
        elif question == visual.COLOUR:
            assert colours == {visual.PALETTE[answer]}
        else:
            assert question == visual.BARS
            height, width = ink_HW.shape
            tops = [np.nonzero(half.any(axis=1))[0] for half in np.hsplit(ink_HW, [width // 2])]
            left, right = (height - top.min() for top in tops)  # each half holds one bar
            assert ink_HW[-1].any() and abs(left - right) >= max(4, height // 4)
            assert answer == ("left" if left > right else "right")


def test_sizes_and_answers_vary_within_bounds(written):
    rows = read(written, "train") + read(written, "eval")
    sizes = Counter(pixels_HWC.shape[:2] for _, pixels_HWC, _ in rows)
    assert set(sizes) == {(h, w) for h in (28, 56, 84) for w in (28, 56, 84)}
    answers = Counter((question, answer) for question, _, answer in rows)
    assert {a for q, a in answers if q == visual.COUNT} == {"1", "2", "3", "4"}
    assert {a for q, a in answers if q == visual.COLOUR} == set(visual.PALETTE)
    assert {a for q, a in answers if q == visual.BARS} == {"left", "right"}
    assert min(answers.values()) >= 20  # 400 rows over 10 (question, answer) pairs


def test_no_held_out_row_has_a_training_twin(written):
    def twins(name):
        return {(q, p.shape, p.tobytes()) for q, p, _ in read(written, name)}

    train, held_out = twins("train"), twins("eval")
    assert len(train) == 300 and len(held_out) == 100 and not train & held_out


def test_twins_are_redrawn(monkeypatch):
    """With two possible images, one held-out and one training row are the two, not a repeat."""

    def flat(rng, width, height):
        name = rng.choice(["red", "blue"])
        return Image.new("RGB", (width, height), visual.PALETTE[name]), name

    monkeypatch.setattr(visual, "QUESTIONS", {visual.COLOUR: flat})
    monkeypatch.setattr(visual, "SIDES", (28,))
    drawn = visual.split(seed=0, train_rows=1, eval_rows=1)
    assert {drawn["eval"][0][2], drawn["train"][0][2]} == {"red", "blue"}


def test_same_seed_same_files_and_held_out_rows_independent_of_train_rows(tmp_path):
    for name, seed, train_rows in (("a", 3, 20), ("b", 3, 20), ("c", 4, 20), ("d", 3, 5)):
        visual.write(tmp_path / name, seed=seed, train_rows=train_rows, eval_rows=10)

    def files(name):
        root = tmp_path / name
        return {p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file()}

    assert files("a") == files("b") and len(files("a")) == 3 + 30  # train, eval, sft
    assert files("a") != files("c")
    held_out = {p: b for p, b in files("a").items() if not p.name.startswith(("train", "sft"))}
    assert held_out.items() <= files("d").items()


def test_text_is_in_the_tiny_tokenizer_alphabet(written):
    alphabet = set(tokenizer_alphabet())
    for name in ("train", "eval"):
        for question, _, answer in read(written, name):
            assert set(question + answer) <= alphabet, (question, answer)


@pytest.mark.parametrize(
    ("completion", "answer", "reward"),
    [
        ("red", "red", 1.0),
        (" left\n", "left", 1.0),
        ("3", "3", 1.0),
        ("der", "red", 0.0),
        ("red.", "red", 0.0),
        ("the answer is red", "red", 0.0),
        ("", "red", 0.0),
    ],
)
def test_exact_match_reward(completion, answer, reward):
    assert exact_match_reward("what colour is the shape?", completion, answer) == reward
