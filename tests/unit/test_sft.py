"""SFT data, in process: only the assistant tokens are trained, prompt rows, bad rows named
file:row, values an SFT run would ignore. Real runs: tests/integration/test_sft.py and
test_resume.py.

    .venv/bin/python -m pytest tests/unit/test_sft.py
"""

import json
from pathlib import Path

import pytest
from helpers.launch import REPO

from torchtitan_rl.config import ConfigError, parse_args
from torchtitan_rl.tasks.render import load_tokenizer
from torchtitan_rl.tasks.sft_data import open_sft_data, sft_batch

TINY = str(REPO / "assets" / "tiny_qwen3")
IM_END = 4  # the tiny checkpoint's <|im_end|>, its first stop id
SFT = ("--job.config_file", "run_configs/sft_arith_cpu.toml")


def sft_config(tmp_path: Path, rows: list[dict], *flags: str):
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    argv = ["--model.hf_checkpoint", TINY, "--task.name", "dataset", "--task.dataset_path"]
    return parse_args([*argv, str(data), *flags], entry="sft")


def test_only_the_assistant_tokens_are_trained(tmp_path):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "max(1,2)="},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "min(1,2)="},
        {"role": "assistant", "content": "1"},
    ]
    config = sft_config(tmp_path, [{"messages": messages}], "--task.messages_key", "messages")
    data = open_sft_data(config)
    tokenizer = load_tokenizer(TINY)
    # One row per assistant message, its prompt the messages before it.
    assert [e.response for e in data.examples] == ["2", "1"]
    for example, turn in zip(data.examples, (2, 4), strict=True):
        prompt = tokenizer.apply_chat_template(
            messages[:turn], tokenize=False, add_generation_prompt=True
        )
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        response_ids = tokenizer.encode(messages[turn]["content"], add_special_tokens=False)
        assert example.tokens == prompt_ids + response_ids + [IM_END]
        assert example.prompt_len == len(prompt_ids)
    batch = sft_batch(data.examples)
    first, width = data.examples[0], batch.tokens_BT.shape[1]
    padding = [0.0] * (width - len(first))
    assert batch.loss_mask_BT[0].tolist() == [0.0] * first.prompt_len + [1.0, 1.0] + padding
    assert tokenizer.decode(batch.tokens_BT[0][batch.loss_mask_BT[0].bool()]) == "2<|im_end|>"
    # The second row's context holds the first answer, its system and user turns: none trained.
    second = batch.loss_mask_BT[1]
    assert second.sum() == 2 and tokenizer.decode(batch.tokens_BT[1][second.bool()]) == (
        "1<|im_end|>"
    )


def test_prompt_rows_train_the_answer_after_the_rendered_prompt(tmp_path):
    config = sft_config(
        tmp_path, [{"prompt": "max(3,7)=", "answer": "7"}], "--task.system_prompt", "digits"
    )
    (example,) = open_sft_data(config).examples
    tokenizer = load_tokenizer(TINY)
    prompt = tokenizer.decode(example.tokens[: example.prompt_len])
    assert prompt == (
        "<|im_start|>system\ndigits<|im_end|>\n<|im_start|>user\nmax(3,7)=<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert example.tokens[example.prompt_len :] == tokenizer.encode("7") + [IM_END]


@pytest.mark.parametrize(
    ("rows", "flags", "message"),
    [
        (
            [{"prompt": "p", "answer": "x" * 80}],
            (),
            r"sft.jsonl:1: 101 tokens after the chat template \(prompt 20, response 81\), more "
            r"than sft.max_seq_len = 64",
        ),
        (
            [{"messages": [{"role": "user", "content": "hi"}]}],
            ("--task.messages_key", "messages"),
            'sft.jsonl:1: no "assistant" message to train on',
        ),
        (
            [{"messages": [{"role": "assistant", "content": "hi"}]}],
            ("--task.messages_key", "messages"),
            "sft.jsonl:1: assistant message 0 has no user message before it",
        ),
        ([{"prompt": "p"}], (), r'sft.jsonl:1: needs an "answer" \(task.answer_key\)'),
    ],
)
def test_bad_rows_name_the_file_row_and_the_fix(tmp_path, rows, flags, message):
    with pytest.raises(ConfigError, match=message):
        open_sft_data(sft_config(tmp_path, rows, "--sft.max_seq_len", "64", *flags))


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ("--generator.sampling.n", "4"),
            r"generator.sampling.n = 4: an SFT run does not use it; remove it",
        ),
        (
            ("--training.max_prompt_len", "8"),
            r"training.max_prompt_len = 8: an SFT run does not use it \(sft.max_seq_len does",
        ),
        (("--algorithm.loss", "dapo"), "algorithm.loss = 'dapo': an SFT run does not use it"),
        (("--sft.batch_size", "3"), "sft.batch_size = 3 does not split over 2 data-parallel"),
        (
            ("--sft.micro_batch_tokens", "16"),
            "sft.micro_batch_tokens = 16 cannot hold one row of sft.max_seq_len = 32",
        ),
    ],
)
def test_sft_refuses_values_it_would_ignore(flags, message, repo_cwd):
    with pytest.raises(ConfigError, match=message):
        parse_args([*SFT, *flags], world_size=2, entry="sft")


def test_sft_needs_a_dataset():
    with pytest.raises(ConfigError, match="task.name = 'echo_digits': SFT trains on the rows"):
        parse_args(["--model.hf_checkpoint", TINY], entry="sft")


def test_an_rl_run_refuses_an_sft_section(repo_cwd):
    with pytest.raises(ConfigError, match=r"the \[sft\] section is for python -m torchtitan_rl"):
        parse_args(["--job.config_file", "run_configs/arith_cpu.toml", "--sft.batch_size", "8"])
