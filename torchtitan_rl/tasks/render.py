"""Prompts to token ids with the checkpoint's own chat template, and completions back to text.

.venv/bin/python -m pytest tests/unit/test_datasets.py

Rendering is transformers' `apply_chat_template` on the checkpoint's tokenizer files: it reads
the `chat_template` HF checkpoints ship (tokenizer_config.json or chat_template.jinja) and
renders it with jinja2, as vLLM's and TRL's chat paths do, so a prompt here is the prompt the
model saw in its own fine-tuning. The text it renders is then encoded without adding special
tokens (the template writes them). `task.chat_template = false` encodes the prompt text as is.
"""

import functools
from pathlib import Path

from torchtitan_rl.config import ConfigError, ModelSection, read_json
from torchtitan_rl.config.task import SourceSection
from torchtitan_rl.types import Images, Prompt
from torchtitan_rl.vision.preprocess import IMAGE_TOKEN, ImageProcessorConfig
from torchtitan_rl.vision.prompts import ImageReader, image_parts

# What AutoTokenizer reads as JSON from a checkpoint folder, when there.
_TOKENIZER_JSON_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.json",
    "config.json",
)


@functools.cache
def load_tokenizer(tokenizer_dir: str):
    """The checkpoint's tokenizer (transformers, from local files only); loaded once, shared by
    the renderers of a mixture's sources."""
    from transformers import AutoTokenizer

    names = [name for name in _TOKENIZER_JSON_FILES if (Path(tokenizer_dir) / name).is_file()]
    for name in names:  # a file cut short is named, not a bare JSON error
        read_json(tokenizer_dir, name, "model.tokenizer_path")
    read_tokenizer_json(tokenizer_dir)  # missing, or JSON that is not a tokenizer
    try:
        return AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    except ImportError:
        raise  # a missing package, not a damaged file
    except Exception as e:  # valid JSON of the wrong shape: KeyError, TypeError, tokenizers'
        reason = str(e).splitlines()[0] if str(e) else ""
        raise ConfigError(
            f"model.tokenizer_path = '{tokenizer_dir}': transformers cannot load the tokenizer "
            f"from {', '.join(names)} ({type(e).__name__}: {reason}): download them again"
        ) from None


def read_tokenizer_json(tokenizer_dir: str):
    """The `tokenizers` Tokenizer of tokenizer.json in `tokenizer_dir`; a missing or damaged
    file is a ConfigError naming it."""
    from tokenizers import Tokenizer

    path = Path(tokenizer_dir) / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(f"model.tokenizer_path = '{tokenizer_dir}' has no tokenizer.json")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
        raise ConfigError(
            f"model.tokenizer_path = '{tokenizer_dir}': tokenizer.json is damaged "
            f"({str(e).splitlines()[0] if str(e) else type(e).__name__}): download it again"
        ) from None


# Stands for the sampled assistant turn when rendering what follows it (Renderer.reply_ids).
_STAND_IN = "<<the sampled turn>>"


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
        images: ImageReader | None = None,
    ):
        """`tokenizer`: a transformers tokenizer (`load_tokenizer`), read from `tokenizer_dir`.
        `length_field`: the config field holding `max_prompt_len`, named in its error.
        `images`: a vision-language model's image processor (`image_reader`); None: prompts
        with images are refused."""
        self.tokenizer, self.tokenizer_dir = tokenizer, tokenizer_dir
        self.chat_template, self.system_prompt = chat_template, system_prompt
        self.enable_thinking, self.max_prompt_len = enable_thinking, max_prompt_len
        self.length_field = length_field
        self.images = images

    def messages(self, prompt: Prompt) -> list[dict]:
        """The chat messages of `prompt`: its own, or its text as the user's, after the system
        prompt (when the row brings no system message of its own)."""
        messages = list(prompt.messages or [{"role": "user", "content": prompt.text}])
        if self.system_prompt is not None and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    def text(self, prompt: Prompt, tools: list[dict] | None = None) -> str:
        """What the model reads: the rendered chat with the generation prompt, or the text."""
        if not self.chat_template:
            return prompt.text
        return self.chat(self.messages(prompt), tools, generation_prompt=True)

    def chat(self, messages: list[dict], tools: list[dict] | None, generation_prompt: bool) -> str:
        """`messages` (and `tools`, for templates that show them) through the chat template."""
        extra = {} if self.enable_thinking is None else {"enable_thinking": self.enable_thinking}
        if tools:
            extra["tools"] = tools
        from jinja2 import TemplateSyntaxError

        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt, **extra
            )
        except TemplateSyntaxError as e:  # a template cut short; not one that raises on a chat
            reason = (e.message or "").rstrip(".")
            raise ConfigError(
                f"model.tokenizer_path = '{self.tokenizer_dir}': its chat template "
                "(tokenizer_config.json 'chat_template' or chat_template.jinja) does not parse "
                f"({reason}, line {e.lineno}): download the tokenizer files again, or set "
                "task.chat_template = false for raw text prompts"
            ) from None

    def reply_ids(
        self,
        history: list[dict],
        replies: list[dict],
        tools: list[dict] | None,
        stop_id: int | None,
    ) -> list[int]:
        """The ids that follow an assistant turn the model ended with stop token `stop_id`
        (None: on a stop string): the rest of the turn's closing text, the environment's
        `replies`, and the next generation prompt (`reply_text`, encoded)."""
        return self.tokenizer.encode(
            self.reply_text(history, replies, tools, stop_id), add_special_tokens=False
        )

    def encode_reply(
        self,
        history: list[dict],
        replies: list[dict],
        tools: list[dict] | None,
        stop_id: int | None,
    ) -> tuple[list[int], Images | None]:
        """`reply_ids`, and the images of the replies' image parts placed in them (None
        without any). An image the model cannot read, or any image for a text-only model: one
        ValueError line."""
        found = image_parts(replies)
        if found and self.images is None:
            raise ValueError(
                f"the reply holds {len(found)} image(s), but the model reads no images (a "
                "text-only model): reply with text, or use a vision-language flavor"
            )
        pixels = self.images.read(found) if found else None
        return self.encode_chat(self.reply_text(history, replies, tools, stop_id), pixels)

    def reply_text(
        self,
        history: list[dict],
        replies: list[dict],
        tools: list[dict] | None,
        stop_id: int | None,
    ) -> str:
        """The text of `reply_ids`: what follows the sampled turn, as the chat template
        renders it.

        The sampled turn is never re-encoded: the chat is rendered with a stand-in for it,
        before and after `replies`, and only the text after the stand-in is encoded, less
        the stop token when the template closes the turn with it (the model sampled it).
        That text starts at a special token or right after one, so it encodes on its own as
        it would within the whole chat. A turn that stopped otherwise (a stop string, another
        stop id) gets the template's whole closing text.
        """
        turn = [{"role": "assistant", "content": _STAND_IN}]
        before = self.chat(history + turn, tools, generation_prompt=False)
        after = self.chat(history + turn + replies, tools, generation_prompt=True)
        if not after.startswith(before) or _STAND_IN not in before:
            raise ConfigError(
                f"{self.tokenizer_dir}: its chat template does not render a chat as the chat "
                "before it plus the new messages, so an episode cannot grow turn by turn "
                "without re-encoding what the model sampled: use a template that appends "
                "(Qwen3's, Llama 3's), or let the environment answer with tool messages rather "
                "than user ones"
            )
        cut = before.rindex(_STAND_IN) + len(_STAND_IN)
        stop = "" if stop_id is None else self.tokenizer.decode([stop_id])
        if stop and before.startswith(stop, cut):
            cut += len(stop)
        return before[cut:] + after[len(before) :]

    def encode(self, prompts: list[Prompt], tools: list[dict] | None = None) -> list[list[int]]:
        """Token ids of each prompt; an empty or too long prompt, or a bad image, is a
        ConfigError naming its source (file:row for dataset rows)."""
        return self.encode_images(prompts, tools)[0]

    def encode_images(
        self, prompts: list[Prompt], tools: list[dict] | None = None
    ) -> tuple[list[list[int]], list[Images | None]]:
        """`encode`, and each prompt's images as the model reads them (None without): each
        image part's placeholder expanded to its run (vision/prompts.py)."""
        ids, images = [], []
        for prompt in prompts:
            where = f"{prompt.row}: " if prompt.row else ""
            if prompt.images and self.images is None:
                raise ConfigError(
                    f"{where}the prompt has {len(prompt.images)} image(s), but the model reads "
                    "no images: use a vision-language flavor (muse_glimmer tiny_vl, 30B_mm), or "
                    "drop the rows' image parts"
                )
            try:
                pixels = self.images.read(prompt.images) if prompt.images else None
                prompt_ids, prompt_images = self.encode_chat(self.text(prompt, tools), pixels)
            except ValueError as e:
                raise ConfigError(f"{where}{e}") from None
            ids.append(prompt_ids)
            images.append(prompt_images)
        self._check(prompts, ids)
        return ids, images

    def encode_chat(self, text: str, pixels: tuple | None) -> tuple[list[int], Images | None]:
        """The ids of rendered `text` whose i-th `<|patch|>` is image i of `pixels`
        ((pixel_values_PX, grid_thw_N3), read by `images.read`; None: no image), expanded to
        its run, and the images placed in them. A count of `<|patch|>` other than the images':
        one ValueError line."""
        if pixels is None:
            return self.tokenizer.encode(text, add_special_tokens=False), None
        ids = self.tokenizer.encode(self.images.expand(text, pixels[1]), add_special_tokens=False)
        return ids, self.images.images(ids, *pixels)

    def _check(self, prompts: list[Prompt], ids: list[list[int]]) -> None:
        for prompt, tokens in zip(prompts, ids, strict=True):
            where = f"{prompt.row}: " if prompt.row else ""
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

    def decode(self, token_ids: list[int]) -> str:
        """The completion's text without special tokens (stop ids, chat markers)."""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)


def image_reader(model: ModelSection) -> ImageReader | None:
    """A vision-language `model`'s image processor (its checkpoint's preprocessor_config.json)
    and placeholder id; None for a text-only model."""
    from torchtitan_rl.models import has_vision_tower

    if not has_vision_tower(model.name, model.flavor):
        return None
    folder = model.hf_checkpoint or model.tokenizer_dir
    try:
        config = ImageProcessorConfig.from_checkpoint(folder)
    except ValueError as e:
        raise ConfigError(f"model.hf_checkpoint = {folder!r}: {e}") from None
    tokenizer = load_tokenizer(model.tokenizer_dir)
    placeholder = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    if placeholder is None or placeholder == tokenizer.unk_token_id:
        raise ConfigError(
            f"model.tokenizer_path = {model.tokenizer_dir!r}: the tokenizer has no {IMAGE_TOKEN} "
            "token, which a vision-language model's prompts hold for each image: use the "
            "checkpoint's own tokenizer"
        )
    return ImageReader(config, placeholder)


def build_renderer(
    task: SourceSection,
    tokenizer_dir: str,
    max_prompt_len: int,
    length_field: str = "training.max_prompt_len",
    at: str = "task",
    images: ImageReader | None = None,
) -> Renderer:
    """The renderer of source section `task` (the config section `at`). Its chat_template
    unset: the checkpoint's chat template for dataset and reasoning_gym tasks when it has one,
    raw text for the toy tasks (their prompts are not chat). `images`: a vision-language
    model's (`image_reader`)."""
    tokenizer = load_tokenizer(tokenizer_dir)
    has_template = bool(getattr(tokenizer, "chat_template", None))
    wanted = task.chat_template
    if wanted is None:
        wanted = task.name in ("dataset", "env", "agent", "reasoning_gym") and has_template
    if task.name in ("env", "agent") and not wanted:
        raise ConfigError(
            f"{at}.name = {task.name!r} renders episodes turn by turn with the chat template, but "
            f"{f'{at}.chat_template = false' if has_template else f'{tokenizer_dir} has none'}: "
            "use a checkpoint that ships a chat template, and leave task.chat_template unset"
        )
    if wanted and not has_template:
        raise ConfigError(
            f"{at}.chat_template = true but {tokenizer_dir} has no chat template "
            "(tokenizer_config.json 'chat_template' or chat_template.jinja): use a checkpoint "
            f"that ships one, or set {at}.chat_template = false for raw text prompts"
        )
    if not wanted:
        for name in ("system_prompt", "enable_thinking", "messages_key"):
            if getattr(task, name) is not None:
                raise ConfigError(
                    f"{at}.{name} = {getattr(task, name)!r} needs a chat template, but prompts "
                    f"are raw text here ({at}.chat_template = {task.chat_template}): set "
                    f"{at}.chat_template = true, or unset it"
                )
    return Renderer(
        tokenizer,
        tokenizer_dir,
        chat_template=wanted,
        system_prompt=task.system_prompt,
        enable_thinking=task.enable_thinking,
        max_prompt_len=max_prompt_len,
        length_field=length_field,
        images=images,
    )
