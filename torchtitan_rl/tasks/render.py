"""Prompts to token ids with the checkpoint's own chat template, and completions back to text.

.venv/bin/python -m pytest tests/test_datasets.py

Rendering is transformers' `apply_chat_template` on the checkpoint's tokenizer files: it reads
the `chat_template` HF checkpoints ship (tokenizer_config.json or chat_template.jinja) and
renders it with jinja2, as vLLM's and TRL's chat paths do, so a prompt here is the prompt the
model saw in its own fine-tuning. The text it renders is then encoded without adding special
tokens (the template writes them). `task.chat_template = false` encodes the prompt text as is.
"""

import json
from pathlib import Path

from torchtitan_rl.config.job_config import ConfigError, TaskSection
from torchtitan_rl.tasks.base import Prompt


def load_tokenizer(tokenizer_dir: str):
    """The checkpoint's tokenizer (transformers, from local files only)."""
    from transformers import AutoTokenizer

    if not (Path(tokenizer_dir) / "tokenizer.json").is_file():
        raise ConfigError(f"model.tokenizer_path = '{tokenizer_dir}' has no tokenizer.json")
    return AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)


def checkpoint_stop_ids(hf_checkpoint: str) -> list[int]:
    """Every id that ends a completion for the checkpoint: the eos_token_id of its
    generation_config.json (an int or a list: Qwen3 lists <|im_end|> and <|endoftext|>), else
    of its config.json."""
    for name in ("generation_config.json", "config.json"):
        path = Path(hf_checkpoint) / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                return [eos] if isinstance(eos, int) else list(eos)
    return []


class Renderer:
    """Prompt -> token ids (chat-templated or raw), token ids -> text."""

    def __init__(
        self,
        tokenizer,
        tokenizer_dir: str,
        *,
        chat_template: bool,
        system_prompt: str | None = None,
        enable_thinking: bool | None = None,
        max_prompt_len: int,
        length_field: str = "training.max_prompt_len",
    ):
        """`tokenizer`: a transformers tokenizer (`load_tokenizer`), read from `tokenizer_dir`.
        `length_field`: the config field holding `max_prompt_len`, named in its error."""
        self.tokenizer, self.tokenizer_dir = tokenizer, tokenizer_dir
        self.chat_template, self.system_prompt = chat_template, system_prompt
        self.enable_thinking, self.max_prompt_len = enable_thinking, max_prompt_len
        self.length_field = length_field

    def messages(self, prompt: Prompt) -> list[dict]:
        """The chat messages of `prompt`: its own, or its text as the user's, after the system
        prompt (when the row brings no system message of its own)."""
        messages = list(prompt.messages or [{"role": "user", "content": prompt.text}])
        if self.system_prompt is not None and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    def text(self, prompt: Prompt) -> str:
        """What the model reads: the rendered chat with the generation prompt, or the text."""
        if not self.chat_template:
            return prompt.text
        extra = {} if self.enable_thinking is None else {"enable_thinking": self.enable_thinking}
        return self.tokenizer.apply_chat_template(
            self.messages(prompt), tokenize=False, add_generation_prompt=True, **extra
        )

    def encode(self, prompts: list[Prompt]) -> list[list[int]]:
        """Token ids of each prompt; an empty or too long prompt is a ConfigError naming its
        source (file:row for dataset rows)."""
        ids = [self.tokenizer.encode(self.text(p), add_special_tokens=False) for p in prompts]
        for prompt, tokens in zip(prompts, ids, strict=True):
            where = f"{prompt.source}: " if prompt.source else ""
            if not tokens:
                raise ConfigError(
                    f"{where}prompt {prompt.text[:40]!r} encodes to no tokens with "
                    f"{self.tokenizer_dir}/tokenizer.json: fix the prompt or use the tokenizer "
                    "the model was trained with"
                )
            if len(tokens) > self.max_prompt_len:
                raise ConfigError(
                    f"{where}prompt {prompt.text[:40]!r} has {len(tokens)} tokens"
                    f"{' after the chat template' if self.chat_template else ''}, more than "
                    f"{self.length_field} = {self.max_prompt_len}: raise it or shorten the "
                    "prompt"
                )
        return ids

    def decode(self, token_ids: list[int]) -> str:
        """The completion's text without special tokens (stop ids, chat markers)."""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)


def build_renderer(
    task: TaskSection,
    tokenizer_dir: str,
    max_prompt_len: int,
    length_field: str = "training.max_prompt_len",
) -> Renderer:
    """The task's renderer. task.chat_template unset: the checkpoint's chat template for dataset
    tasks when it has one, raw text for the toy tasks (their prompts are not chat)."""
    tokenizer = load_tokenizer(tokenizer_dir)
    has_template = bool(getattr(tokenizer, "chat_template", None))
    wanted = task.chat_template
    if wanted is None:
        wanted = task.name == "dataset" and has_template
    if wanted and not has_template:
        raise ConfigError(
            f"task.chat_template = true but {tokenizer_dir} has no chat template "
            "(tokenizer_config.json 'chat_template' or chat_template.jinja): use a checkpoint "
            "that ships one, or set task.chat_template = false for raw text prompts"
        )
    if not wanted:
        for name in ("system_prompt", "enable_thinking", "messages_key"):
            if getattr(task, name) is not None:
                raise ConfigError(
                    f"task.{name} = {getattr(task, name)!r} needs a chat template, but prompts "
                    f"are raw text here (task.chat_template = {task.chat_template}): set "
                    "task.chat_template = true, or unset it"
                )
    return Renderer(
        tokenizer,
        tokenizer_dir,
        chat_template=wanted,
        system_prompt=task.system_prompt,
        enable_thinking=task.enable_thinking,
        max_prompt_len=max_prompt_len,
        length_field=length_field,
    )
