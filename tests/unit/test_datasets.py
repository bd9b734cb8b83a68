"""Datasets and prompt rendering: JSONL/JSON/Parquet through `datasets`, keys, GSM8K answers,
bad rows named file:row, and prompts rendered by the checkpoint's own chat template.

.venv/bin/python -m pytest tests/unit/test_datasets.py
"""

import json
from pathlib import Path

import pytest
from helpers.launch import REPO
from jinja2 import Environment

from torchtitan_rl.config import ConfigError, TaskSection, parse_args
from torchtitan_rl.episodes import open_task
from torchtitan_rl.tasks.dataset import DatasetKeys, read_rows
from torchtitan_rl.tasks.render import build_renderer
from torchtitan_rl.types import Prompt

TINY = str(REPO / "assets" / "tiny_qwen3")
ROWS = [{"prompt": f"{a}+{a + 1}=", "answer": str(2 * a + 1)} for a in range(6)]


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def write_parquet(path: Path, rows: list[dict]) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def as_tuples(prompts: list[Prompt]) -> list[tuple]:
    return [(p.text, p.answer, p.messages) for p in prompts]


def test_parquet_jsonl_json_and_a_folder_of_shards_give_the_same_prompts(tmp_path):
    jsonl = read_rows(write_jsonl(tmp_path / "a.jsonl", ROWS), DatasetKeys())
    parquet = read_rows(write_parquet(tmp_path / "a.parquet", ROWS), DatasetKeys())
    (tmp_path / "a.json").write_text(json.dumps(ROWS))
    plain_json = read_rows(str(tmp_path / "a.json"), DatasetKeys())
    shards = tmp_path / "shards"
    shards.mkdir()
    write_parquet(shards / "part-0.parquet", ROWS[:4])
    write_parquet(shards / "part-1.parquet", ROWS[4:])
    folder = read_rows(str(shards), DatasetKeys())
    assert as_tuples(jsonl) == as_tuples(parquet) == as_tuples(plain_json) == as_tuples(folder)
    assert [p.text for p in jsonl] == [r["prompt"] for r in ROWS]
    assert parquet[2].row == f"{tmp_path / 'a.parquet'}:3"
    assert folder[5].row == f"{shards / 'part-1.parquet'}:2"


def test_keys_messages_and_gsm8k_answers(tmp_path):
    rows = [
        {
            "question": "Tom has 3 apples and buys 1,000 more. How many?",
            "solution": "3 + 1000 = 1003\n#### 1,003",
            "chat": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "how many?"},
            ],
        }
    ]
    path = write_jsonl(tmp_path / "gsm.jsonl", rows)
    keys = DatasetKeys(prompt_key="question", answer_key="solution", answer_format="gsm8k")
    (prompt,) = read_rows(path, keys)
    assert prompt.text.startswith("Tom has") and prompt.answer == "1003"
    keys = DatasetKeys(messages_key="chat", answer_key="solution", answer_format="gsm8k")
    (prompt,) = read_rows(path, keys)
    assert prompt.messages == tuple(rows[0]["chat"]) and prompt.text == "how many?"
    with pytest.raises(ConfigError, match=r"gsm\.jsonl:1: task.answer_format = 'gsm8k' but"):
        read_rows(
            path, DatasetKeys(prompt_key="question", answer_key="question", answer_format="gsm8k")
        )


@pytest.mark.parametrize(
    "rows, message",
    [
        ([ROWS[0], {"answer": "1"}], r'b\.jsonl:2: needs a string "prompt" \(task.prompt_key\)'),
        ([ROWS[0], ROWS[1], {"prompt": " ", "answer": "1"}], r"b\.jsonl:3: the prompt is empty"),
        ([{"prompt": "1+1="}], r'b\.jsonl:1: needs an "answer" \(task.answer_key\)'),
    ],
)
def test_bad_rows_are_named_file_row(tmp_path, rows, message):
    with pytest.raises(ConfigError, match=message):
        read_rows(write_jsonl(tmp_path / "b.jsonl", rows), DatasetKeys())
    # The same rows as Parquet are named the same way.
    with pytest.raises(ConfigError, match=message.replace("jsonl", "parquet")):
        read_rows(write_parquet(tmp_path / "b.parquet", rows), DatasetKeys())


def test_bad_messages_and_missing_paths(tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", [{"chat": "hi", "answer": "1"}])
    with pytest.raises(ConfigError, match=r"m\.jsonl:1: \"chat\" \(task.messages_key\) must be"):
        read_rows(path, DatasetKeys(messages_key="chat"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="the folder holds no .jsonl, .json or .parquet file"):
        read_rows(str(tmp_path / "empty"), DatasetKeys())


def reference_render(messages: list[dict], **kwargs) -> str:
    """The checkpoint's chat template rendered with plain jinja2 (what HF's renderer does)."""
    template = json.loads((Path(TINY) / "tokenizer_config.json").read_text())["chat_template"]
    return Environment().from_string(template).render(messages=messages, **kwargs)


def renderer_for(**task):
    return build_renderer(TaskSection(name="dataset", **task), TINY, max_prompt_len=64)


def test_prompts_render_with_the_checkpoint_chat_template():
    renderer = renderer_for(system_prompt="be brief")
    tokenizer = renderer.tokenizer
    single = Prompt(text="3+4=", answer="7")
    (ids,) = renderer.encode([single])
    expected = reference_render(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "3+4="}],
        add_generation_prompt=True,
    )
    assert ids == tokenizer.encode(expected, add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens(ids[:1]) == ["<|im_start|>"]
    assert expected.endswith("<|im_start|>assistant\n")

    # A row's own messages, with its own system message: the task's is not added.
    conversation = (
        {"role": "system", "content": "terse"},
        {"role": "user", "content": "1+1="},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "2+2="},
    )
    (ids,) = renderer.encode([Prompt(text="2+2=", answer="4", messages=conversation)])
    expected = reference_render(list(conversation), add_generation_prompt=True)
    assert ids == tokenizer.encode(expected, add_special_tokens=False)
    assert expected.count("<|im_start|>") == 5

    # enable_thinking reaches the template (Qwen3's empty think block).
    (ids,) = renderer_for(enable_thinking=False).encode([single])
    assert tokenizer.decode(ids).endswith("assistant\n<think>\n\n</think>\n\n")

    # Raw text stays available.
    raw = build_renderer(TaskSection(name="dataset", chat_template=False), TINY, 64)
    assert raw.encode([single]) == [tokenizer.encode("3+4=", add_special_tokens=False)]
    assert raw.decode(tokenizer.encode("7<|im_end|>", add_special_tokens=False)) == "7"


def test_chat_fields_without_a_template_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="task.system_prompt = 'hi' needs a chat template"):
        build_renderer(
            TaskSection(name="dataset", chat_template=False, system_prompt="hi"), TINY, 8
        )
    # The toy tasks read raw text unless asked.
    assert not build_renderer(TaskSection(), TINY, 8).chat_template
    no_template = tmp_path / "plain"
    no_template.mkdir()
    for name in ("tokenizer.json", "config.json"):
        (no_template / name).write_bytes((Path(TINY) / name).read_bytes())
    with pytest.raises(ConfigError, match="task.chat_template = true but .* has no chat template"):
        build_renderer(TaskSection(name="dataset", chat_template=True), str(no_template), 8)


def test_open_task_reads_the_eval_set_and_checks_every_prompt_length(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", ROWS)
    held_out = write_jsonl(
        tmp_path / "test.jsonl", ROWS[:2] + [{"prompt": "9" * 50, "answer": "1"}]
    )
    flags = ["--model.hf_checkpoint", TINY, "--task.name", "dataset", "--task.dataset_path", train]
    opened = open_task(parse_args(flags))
    assert opened.renderer.chat_template and opened.eval_prompts == []
    with pytest.raises(
        ConfigError, match=r"test\.jsonl:3: prompt '9+' has 69 tokens after the chat"
    ):
        open_task(parse_args([*flags, "--eval.dataset_path", held_out]))


def test_the_shipped_arithmetic_data_is_what_its_script_makes():
    import importlib.util

    import pyarrow.parquet as pq

    spec = importlib.util.spec_from_file_location("arith", REPO / "scripts" / "make_arith_data.py")
    arith = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(arith)
    train, test = arith.split()
    shipped = REPO / "data" / "arith"
    assert [json.loads(x) for x in (shipped / "train.jsonl").read_text().splitlines()] == train
    assert pq.read_table(shipped / "test.parquet").to_pylist() == test

    # No held-out prompt, nor its argument-swapped twin, is trained on; each answer is the
    # operation of both digits; both operations are held out alike.
    def unit(row):
        name, a, b = row["prompt"][:3], row["prompt"][4], row["prompt"][6]
        return name, frozenset((a, b))

    assert not {unit(r) for r in train} & {unit(r) for r in test}
    assert len(train) == 144 and len(test) == 36
    assert sum(r["prompt"].startswith("max") for r in test) == 18
    for row in train + test:
        name, a, b = row["prompt"][:3], int(row["prompt"][4]), int(row["prompt"][6])
        assert row["answer"] == str({"max": max, "min": min}[name](a, b)) and a != b
