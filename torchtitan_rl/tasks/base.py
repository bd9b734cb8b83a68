"""The task protocol and the registry the `task` config section chooses from.

.venv/bin/python -m pytest tests/unit/test_tasks.py
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from torchtitan_rl.config.job_config import ConfigError, JobConfig, TaskSection

if TYPE_CHECKING:
    from torchtitan_rl.episodes import Episodes
    from torchtitan_rl.tasks.render import Renderer
    from torchtitan_rl.tasks.rewards import Scorer


@dataclass(frozen=True, slots=True)
class Prompt:
    text: str
    answer: str
    """What a reward function compares the completion with."""
    source: str = ""
    """Where the prompt comes from, for errors: "file:row" for dataset rows."""
    messages: tuple[dict, ...] | None = None
    """The row's chat messages ({"role", "content"}), when it has them; `text` is then the
    last user message's content."""


def is_chat(messages) -> bool:
    """Whether `messages` is a list of {"role": str, "content": str} chat messages."""
    return isinstance(messages, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages
    )


class Task(Protocol):
    def prompts(self, step: int, count: int, round: int = 0) -> list[Prompt]:
        """The `count` prompts of `step` (the same on every rank; each takes its shard).
        `round` > 0: further, different prompts for the step (dynamic sampling's rounds)."""
        ...

    def reward(self, prompt: Prompt, completion: str) -> float:
        """Reward of `completion` (decoded text, without the stop token) for `prompt`."""
        ...

    def every_prompt(self) -> list[Prompt]:
        """Prompts that cover every prompt length the task can produce (checked at start)."""
        ...


def dataset_keys(task: TaskSection):
    from torchtitan_rl.tasks.dataset import DatasetKeys

    return DatasetKeys(
        prompt_key=task.prompt_key,
        messages_key=task.messages_key,
        answer_key=task.answer_key,
        answer_format=task.answer_format,
    )


def build_task(task: TaskSection, seed: int) -> Task:
    from torchtitan_rl.tasks.dataset import DatasetTask
    from torchtitan_rl.tasks.toy import EchoDigitsTask, ReverseDigitsTask

    if task.name == "echo_digits":
        return EchoDigitsTask(num_digits=task.num_digits, seed=seed)
    if task.name == "reverse_digits":
        return ReverseDigitsTask(num_digits=task.num_digits, seed=seed)
    if task.name in ("dataset", "env"):
        return DatasetTask(task.dataset_path, dataset_keys(task), seed=seed)
    raise ConfigError(
        f"task.name = {task.name!r} is not a task: use echo_digits, reverse_digits, dataset or env"
    )


@dataclass(slots=True)
class OpenTask:
    """What a run needs of its task section, opened and checked: the prompts' source, their
    renderer, the scorer, the episode runner, and the held-out eval prompts (empty without
    eval.dataset_path)."""

    task: Task
    renderer: "Renderer"
    scorer: "Scorer"
    episodes: "Episodes"
    eval_prompts: list[Prompt]


def open_task(config: JobConfig) -> OpenTask:
    """Open the task of `config`: read and check every dataset row (file:row), render every
    prompt (too long after the chat template?), import the reward function. Runs before any
    model or engine is built, so bad data fails in seconds with one line."""
    from torchtitan_rl.episodes import Episodes
    from torchtitan_rl.tasks.dataset import read_rows
    from torchtitan_rl.tasks.env import SingleTurn, load_env
    from torchtitan_rl.tasks.render import build_renderer, checkpoint_stop_ids
    from torchtitan_rl.tasks.rewards import Scorer, load_reward_fn

    section = config.task
    task = build_task(section, seed=config.job.seed)
    renderer = build_renderer(section, config.model.tokenizer_dir, config.training.max_prompt_len)
    reward_fn = load_reward_fn(section.reward_fn) if section.reward_fn else None
    scorer = Scorer(task, reward_fn, section.reward_on_error, section.reward_timeout_s)
    if section.name == "env":
        make_env = load_env(section.env, section.env_kwargs)
    else:
        make_env = lambda: SingleTurn(scorer)  # noqa: E731
    episodes = Episodes(
        renderer,
        make_env,
        scorer,
        stop_ids=checkpoint_stop_ids(config.model.hf_checkpoint or config.model.tokenizer_dir),
        max_turns=section.turns,
        max_model_len=config.generator.max_model_len,
        timeout_s=section.env_timeout_s,
    )
    eval_prompts = []
    if config.eval.dataset_path is not None:
        keys = dataset_keys(section)
        eval_prompts = read_rows(config.eval.dataset_path, keys, "eval.dataset_path")
    renderer.encode(task.every_prompt() + eval_prompts)  # each fits, or one line says which
    return OpenTask(task, renderer, scorer, episodes, eval_prompts)
