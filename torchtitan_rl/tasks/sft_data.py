"""Demonstrations to SFT rows: the rendered prompt (not trained) and the response (trained).

.venv/bin/python -m pytest tests/*/test_sft.py

A dataset row's response is the text under task.answer_key (a prompt row), or each assistant
message under task.messages_key (one training row per assistant message, its prompt being the
messages before it). The prompt is rendered exactly as the RL run renders its prompts (the same
Renderer: chat template, system prompt, enable_thinking, generation prompt); the response is
its text encoded without special tokens, then the checkpoint's first stop id (Qwen3's
<|im_end|>). So an SFT row is token for token what the RL generator samples when the model
answers that way, and the two stages cannot disagree on the template. Shapes: B rows, T tokens.
"""

from dataclasses import dataclass

import torch

from torchtitan_rl.config import ConfigError, JobConfig
from torchtitan_rl.models import checkpoint_stop_ids
from torchtitan_rl.tasks.dataset import DatasetKeys, read_rows
from torchtitan_rl.tasks.render import Renderer, build_renderer, image_reader
from torchtitan_rl.types import Images, Prompt, RolloutBatch
from torchtitan_rl.vision.prompts import image_parts


@dataclass(frozen=True, slots=True)
class Example:
    """One training row: prompt ids then response ids (the stop id last)."""

    tokens: list[int]
    prompt_len: int
    """The first prompt_len tokens are context; the rest are trained."""
    prompt: Prompt
    """The prompt it renders (its source names file:row), for greedy samples."""
    response: str
    images: Images | None = None
    """The prompt's images (a vision-language model's rows)."""

    def __len__(self) -> int:
        return len(self.tokens)


def response_stop_id(renderer: Renderer, stop_ids: list[int]) -> int:
    """The id that ends a response: the checkpoint's first stop id (`stop_ids`, from its
    generation_config.json), else the tokenizer's eos token."""
    if stop_ids:
        return stop_ids[0]
    eos = renderer.tokenizer.eos_token_id
    if eos is None:
        raise ConfigError(
            f"{renderer.tokenizer_dir} names no stop token (no eos_token_id in "
            "generation_config.json or config.json, no tokenizer eos_token): SFT ends each "
            "response with one; use a checkpoint that has one"
        )
    return eos


def turns(row: Prompt) -> list[tuple[Prompt, str]]:
    """(prompt, response) pairs of a row: its answer, or each of its assistant messages."""
    if row.messages is None:
        return [(row, row.answer)]
    pairs = []
    for i, message in enumerate(row.messages):
        if message["role"] != "assistant":
            continue
        context = row.messages[:i]
        if not any(m["role"] != "system" for m in context):
            raise ConfigError(
                f"{row.row}: assistant message {i} has no user message before it to answer"
            )
        user = next(m["content"] for m in reversed(context) if m["role"] == "user")
        if not isinstance(user, str):  # content parts: the text parts
            user = "".join(p["text"] for p in user if p["type"] == "text")
        images = tuple(image_parts(context))
        prompt = Prompt(text=user, answer="", row=row.row, messages=context, images=images)
        pairs.append((prompt, message["content"]))
    if not pairs:
        raise ConfigError(
            f'{row.row}: no "assistant" message to train on (task.messages_key rows need one)'
        )
    return pairs


def read_examples(
    path: str,
    keys: DatasetKeys,
    renderer: Renderer,
    stop_id: int,
    max_seq_len: int,
    field: str = "task.dataset_path",
) -> list[Example]:
    """Every SFT row of the dataset at `path`; a bad or too long row is a ConfigError naming
    file:row and the field to change."""
    examples = []
    for row in read_rows(path, keys, field):
        for prompt, response in turns(row):
            (prompt_ids,), (images,) = renderer.encode_images([prompt])
            response_ids = renderer.tokenizer.encode(response, add_special_tokens=False)
            tokens = prompt_ids + response_ids + [stop_id]
            if len(tokens) > max_seq_len:
                raise ConfigError(
                    f"{row.row}: {len(tokens)} tokens after the chat template (prompt "
                    f"{len(prompt_ids)}, response {len(response_ids) + 1}), more than "
                    f"sft.max_seq_len = {max_seq_len}: raise it or shorten the row"
                )
            examples.append(Example(tokens, len(prompt_ids), prompt, response, images))
    return examples


@dataclass(frozen=True, slots=True)
class SFTData:
    """An SFT run's rows, opened and checked: training rows, held-out rows (empty without
    eval.dataset_path), the renderer that made them and the checkpoint's stop ids."""

    examples: list[Example]
    held_out: list[Example]
    renderer: Renderer
    stop_ids: set[int]


def open_sft_data(config: JobConfig) -> SFTData:
    """Read, render and check every row of task.dataset_path and eval.dataset_path."""
    task, max_seq_len = config.task, config.sft.max_seq_len
    keys = DatasetKeys(
        prompt_key=task.prompt_key,
        messages_key=task.messages_key,
        answer_key=None if task.messages_key else task.answer_key,
    )
    renderer = build_renderer(
        task,
        config.model.tokenizer_dir,
        max_seq_len,
        "sft.max_seq_len",
        images=image_reader(config.model),
    )
    hf_checkpoint = config.model.hf_checkpoint
    checkpoint_stops = checkpoint_stop_ids(hf_checkpoint) if hf_checkpoint else []
    stop_id = response_stop_id(renderer, checkpoint_stops)
    examples = read_examples(task.dataset_path, keys, renderer, stop_id, max_seq_len)
    held_out = []
    if config.eval.dataset_path is not None:
        held_out = read_examples(
            config.eval.dataset_path, keys, renderer, stop_id, max_seq_len, "eval.dataset_path"
        )
    return SFTData(examples, held_out, renderer, set(checkpoint_stops) | {stop_id})


def sft_batch(examples: list[Example], pad_id: int = 0) -> RolloutBatch:
    """Right-padded rows [B, T] with the loss mask on the response tokens (stop id included)."""
    width = max(len(e) for e in examples)
    tokens_BT = torch.full((len(examples), width), pad_id, dtype=torch.long)
    loss_mask_BT = torch.zeros(len(examples), width)
    for b, example in enumerate(examples):
        tokens_BT[b, : len(example)] = torch.tensor(example.tokens)
        loss_mask_BT[b, example.prompt_len : len(example)] = 1.0
    images_B = tuple(e.images for e in examples)
    return RolloutBatch(
        tokens_BT=tokens_BT,
        loss_mask_BT=loss_mask_BT,
        images_B=None if all(i is None for i in images_B) else images_B,
    )
