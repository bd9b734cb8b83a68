"""What the run trains and evaluates on: the [task] and [eval] sections.

    .venv/bin/python -m pytest tests/unit/test_tasks.py tests/unit/test_eval.py

A run has one task ([task] alone) or a weighted mixture of sources ([task.sources.NAME]
tables, each with the fields of a task plus its weight and eval set). Values only: the
datasets, their rows and the reward functions are checked when the task is opened
(episodes.open_task), before any model is built.
"""

import math
import os
import re
from dataclasses import dataclass, field, fields
from typing import Literal

from torchtitan_rl.config.errors import ConfigError, first_change, require


@dataclass(kw_only=True, slots=True)
class SourceSection:
    """Where prompts come from and how they are rewarded: the fields of a one-task [task]
    section, and of each [task.sources.NAME] of a mixture."""

    name: Literal["echo_digits", "reverse_digits", "dataset", "env", "agent", "reasoning_gym"] = (
        "echo_digits"
    )
    """echo_digits ('echo 407:' -> '407'), reverse_digits ('reverse 407:' -> '704'),
    dataset: the rows of task.dataset_path, scored by math-verify, env: episodes of the
    environment task.env on the rows of task.dataset_path (multi-turn, tools), agent:
    episodes an agent drives through the OpenAI-compatible gateway (task.agent or
    task.agent_url; docs/agents.md), or reasoning_gym: questions of the reasoning-gym
    generator task.reasoning_gym, scored by its own score_answer (docs/data_and_eval.md)."""
    num_digits: int = 1
    """Digits per prompt (echo_digits, reverse_digits)."""
    dataset_path: str | None = None
    """A local JSONL, JSON or Parquet file, or a folder of such shards (task.name = dataset)."""
    prompt_key: str = "prompt"
    """The row's prompt string, rendered as the user message."""
    messages_key: str | None = None
    """The row's chat messages ([{"role", "content"}, ...]) instead of a prompt string."""
    answer_key: str = "answer"
    """The row's answer, which the reward compares the completion with."""
    answer_format: Literal["raw", "gsm8k"] = "raw"
    """raw: the answer as it is; gsm8k: what follows '####' in the answer (GSM8K's solutions)."""
    chat_template: bool | None = None
    """Render prompts with the checkpoint's chat template (transformers' apply_chat_template);
    false: the prompt text as is. Unset: the template for task.name = dataset when the
    checkpoint has one, raw text for the toy tasks."""
    system_prompt: str | None = None
    """System message put before each prompt's messages (needs the chat template)."""
    enable_thinking: bool | None = None
    """Passed to the chat template (Qwen3: false renders an empty think block, so the model
    answers without reasoning); unset: the template's default."""
    reward_fn: str | None = None
    """Custom reward `module:function(prompt, completion, answer) -> float`; None: the task's.
    It may be `async`, or batched (`@torchtitan_rl.tasks.rewards.batched`: lists in, a list
    out, one call per step and rank; docs/data_and_eval.md)."""
    rewards: dict[str, float] = field(default_factory=dict)
    """Several reward functions and their weights, a [task.rewards] table of
    "module:function" = weight: the reward is the weighted sum, and each function's mean is
    logged as reward/<function>. Instead of task.reward_fn."""
    env: str | None = None
    """The environment class 'module:Class' (task.name = env), built per episode with
    task.env_kwargs; torchtitan_rl.tasks.env:Calculator is the built-in example (a calc tool
    on the arithmetic rows). See docs/environments.md."""
    env_kwargs: dict[str, bool | int | float | str] = field(default_factory=dict)
    """Keyword arguments of the environment class (a [task.env_kwargs] table)."""
    max_turns: int | None = None
    """Most assistant turns of an episode (task.name = env, unset: 4; agent, unset: 16); an
    environment's episode still going after it ends as truncated, an agent's further requests
    are answered 400."""
    agent: str | None = None
    """The agent 'module:function' (task.name = agent): `async def function(client: openai.
    AsyncOpenAI, model: str, row: dict) -> float | None`, one call per episode (tasks/agent.py);
    torchtitan_rl.tasks.calculator_agent:calculator is the built-in example."""
    agent_url: str | None = None
    """An agent server instead of task.agent (task.name = agent): POST {agent_url} with
    {"base_url", "api_key", "model", "row"} per episode, answered {"reward": float | null}."""
    tool_parser: str | None = "hermes"
    """vLLM's tool-call parser for an agent's chat turns (vllm.tool_parsers: hermes reads
    Qwen3's and Hermes' <tool_call> JSON); none: tool calls stay text."""
    reasoning_parser: str | None = None
    """vLLM's reasoning parser for an agent's chat turns (e.g. qwen3: the <think> block goes to
    reasoning_content); unset: the text is all content."""
    reasoning_gym: str | None = None
    """The reasoning-gym generator (task.name = reasoning_gym), e.g. 'chain_sum' or
    'basic_arithmetic'; its entries' questions are the prompts (the user message)."""
    reasoning_gym_config: dict[str, bool | int | float | str | list[bool | int | float | str]] = (
        field(default_factory=dict)
    )
    """The generator's settings, a [task.reasoning_gym_config] table (chain_sum: min_terms,
    max_terms, min_digits, max_digits, ...); unset ones keep reasoning-gym's defaults. Its
    seed and size are task.reasoning_gym_seed and task.reasoning_gym_size."""
    reasoning_gym_size: int = 1000
    """Entries generated for training, read in epochs like a dataset's rows."""
    reasoning_gym_seed: int = 0
    """The training entries' seed (what they are; job.seed orders them)."""
    reasoning_gym_eval_size: int = 0
    """Held-out entries generated with task.reasoning_gym_eval_seed, less any question the
    training entries have; 0: the source is not evaluated."""
    reasoning_gym_eval_seed: int | None = None
    """The held-out entries' seed; unset: reasoning_gym_seed + reasoning_gym_size, past every
    seed the training entries used (a generator seeds entry i with seed + i)."""
    answer_extraction: Literal["last_number", "answer_tags", "raw"] | None = None
    """What of the reply the generator's score_answer scores (task.name = reasoning_gym):
    last_number (the reply's last number, e.g. '12' of '... so the sum is 12.'), answer_tags
    (the last <answer>...</answer>, reasoning-gym's own format: ask for it in
    task.system_prompt), or raw (the whole reply). Unset: last_number."""
    learn_from: Literal["reward", "teacher", "both"] | None = None
    """What this source's samples learn from: the task's reward (advantages from it), the
    [distill] teacher alone (its per-token signal; rewards are still logged), or both (the
    teacher's per-token advantage added to the reward's). Unset: teacher when
    distill.teacher_checkpoint is set, else reward."""

    @property
    def turns(self) -> int:
        """Most assistant turns of an episode (1: a single-turn task)."""
        if self.name not in ("env", "agent"):
            return 1
        if self.max_turns is None:
            return 4 if self.name == "env" else 16
        return self.max_turns

    def validate(self, at: str = "task") -> None:
        """Values only (`at`: the section's dotted name, task or task.sources.NAME); the
        dataset, its rows and the reward functions are checked when the task is opened."""
        require(self.num_digits >= 1, f"{at}.num_digits = {self.num_digits}: must be >= 1")
        require(
            self.name not in ("dataset", "env", "agent") or self.dataset_path is not None,
            f"{at}.name = {self.name!r} needs {at}.dataset_path: a JSONL, JSON or Parquet file "
            '(or a folder of them) of {"prompt": ..., "answer": ...} rows',
        )
        require(
            self.dataset_path is None or self.name in ("dataset", "env", "agent"),
            f"{at}.dataset_path is set but {at}.name = {self.name!r} does not read it: set "
            f"{at}.name = 'dataset', or unset {at}.dataset_path",
        )
        require(
            self.name != "env" or self.env is not None,
            f"{at}.name = 'env' needs {at}.env = 'module:Class', e.g. "
            "'torchtitan_rl.tasks.env:Calculator'",
        )
        require(
            self.env is None or self.name == "env",
            f"{at}.env = {self.env!r} but {at}.name = {self.name!r}: set {at}.name = 'env', or "
            "unset it",
        )
        require(
            self.max_turns is None or self.name in ("env", "agent"),
            f"{at}.max_turns = {self.max_turns!r} but {at}.name = {self.name!r} runs "
            f"single-turn episodes: set {at}.name = 'env' or 'agent', or unset it",
        )
        require(
            self.name != "agent" or (self.agent is None) != (self.agent_url is None),
            f"{at}.name = 'agent' needs one of {at}.agent = 'module:function' or "
            f"{at}.agent_url = 'http://...', e.g. "
            "'torchtitan_rl.tasks.calculator_agent:calculator'",
        )
        for name in ("agent", "agent_url", "reasoning_parser"):
            require(
                getattr(self, name) is None or self.name == "agent",
                f"{at}.{name} = {getattr(self, name)!r} but {at}.name = {self.name!r}: set "
                f"{at}.name = 'agent', or unset it",
            )
        require(
            self.agent is None or self.agent.count(":") == 1,
            f"{at}.agent = {self.agent!r}: write it as 'module:function'",
        )
        require(
            self.agent_url is None or self.agent_url.startswith(("http://", "https://")),
            f"{at}.agent_url = {self.agent_url!r}: must be an http:// or https:// URL",
        )
        require(
            not self.env_kwargs or self.name == "env",
            f"{at}.env_kwargs = {self.env_kwargs!r} but {at}.name = {self.name!r} builds no "
            f"environment: set {at}.name = 'env', or remove the table",
        )
        require(
            self.env is None or self.env.count(":") == 1,
            f"{at}.env = {self.env!r}: write it as 'module:Class'",
        )
        require(
            self.reward_fn is None or self.name != "env",
            f"{at}.reward_fn = {self.reward_fn!r}: with {at}.name = 'env' the environment "
            f"gives the rewards (EnvStep.reward); unset {at}.reward_fn",
        )
        require(
            self.max_turns is None or self.max_turns >= 1,
            f"{at}.max_turns = {self.max_turns}: must be >= 1",
        )
        require(
            self.dataset_path is None or os.path.exists(self.dataset_path),
            f"{at}.dataset_path = {self.dataset_path!r}: no such file or folder",
        )
        require(
            self.reward_fn is None or self.reward_fn.count(":") == 1,
            f"{at}.reward_fn = {self.reward_fn!r}: write it as 'module:function'",
        )
        require(
            not (self.reward_fn and self.rewards),
            f"{at}.reward_fn = {self.reward_fn!r} and {at}.rewards are both set: list every "
            f"function with its weight in {at}.rewards, or keep only {at}.reward_fn",
        )
        require(
            not self.rewards or self.name != "env",
            f"{at}.rewards is set but with {at}.name = 'env' the environment gives the rewards "
            f"(EnvStep.reward): remove the [{at}.rewards] table",
        )
        self._validate_reasoning_gym(at)
        for spec, weight in self.rewards.items():
            require(
                spec.count(":") == 1,
                f"{at}.rewards[{spec!r}]: write the function as 'module:function'",
            )
            require(
                math.isfinite(weight) and weight != 0,
                f"{at}.rewards[{spec!r}] = {weight}: a weight must be finite and not 0 (a "
                "function of weight 0 changes nothing: remove it)",
            )

    def _validate_reasoning_gym(self, at: str) -> None:
        """The reasoning_gym fields' values; the generator and its settings are checked when
        the task is opened (tasks/reasoning_gym.py)."""
        if self.name != "reasoning_gym":
            for name in ("reasoning_gym", "reasoning_gym_eval_seed", "answer_extraction"):
                require(
                    getattr(self, name) is None,
                    f"{at}.{name} = {getattr(self, name)!r} but {at}.name = {self.name!r}: set "
                    f"{at}.name = 'reasoning_gym', or unset it",
                )
            for name in ("reasoning_gym_config", "reasoning_gym_eval_size"):
                require(
                    not getattr(self, name),
                    f"{at}.{name} = {getattr(self, name)!r} but {at}.name = {self.name!r}: set "
                    f"{at}.name = 'reasoning_gym', or remove it",
                )
            return
        require(
            self.reasoning_gym is not None,
            f"{at}.name = 'reasoning_gym' needs {at}.reasoning_gym = 'GENERATOR', e.g. "
            "'chain_sum' or 'basic_arithmetic'",
        )
        require(
            self.reasoning_gym_size >= 1,
            f"{at}.reasoning_gym_size = {self.reasoning_gym_size}: must be >= 1",
        )
        require(
            self.reasoning_gym_eval_size >= 0,
            f"{at}.reasoning_gym_eval_size = {self.reasoning_gym_eval_size}: must be >= 0 (0: "
            "no held-out set)",
        )
        for key in ("seed", "size"):
            require(
                key not in self.reasoning_gym_config,
                f"{at}.reasoning_gym_config.{key} = {self.reasoning_gym_config.get(key)!r}: set "
                f"{at}.reasoning_gym_{key} instead (the held-out set has its own, "
                f"{at}.reasoning_gym_eval_{key})",
            )


@dataclass(kw_only=True, slots=True)
class WeightedSource(SourceSection):
    """One [task.sources.NAME] of a mixture: a task's fields, its share of each step's prompts
    and its own eval set."""

    weight: float = 1.0
    """The source's share of each step's prompts is weight / (sum of the weights), drawn per
    step (seeded by job.seed and the step)."""
    eval_dataset_path: str | None = None
    """The source's held-out rows (read with its keys, chat template and rewards); unset: the
    source is not evaluated (a reasoning_gym source: reasoning_gym_eval_size). Its figures are
    eval/accuracy/NAME and eval/pass@k/NAME."""

    def validate(self, at: str = "task") -> None:
        SourceSection.validate(self, at)
        require(
            math.isfinite(self.weight) and self.weight > 0,
            f"{at}.weight = {self.weight}: must be > 0 (remove the source to leave it out)",
        )
        require(
            self.eval_dataset_path is None or self.name != "reasoning_gym",
            f"{at}.eval_dataset_path is set but {at}.name = 'reasoning_gym' generates its "
            f"held-out set: set {at}.reasoning_gym_eval_size, and unset {at}.eval_dataset_path",
        )
        require(
            self.eval_dataset_path is None or self.name in ("dataset", "env", "agent"),
            f"{at}.eval_dataset_path is set but {at}.name = {self.name!r}: evaluation reads "
            f"rows like a dataset's; set {at}.name = 'dataset', or unset it",
        )
        require(
            self.eval_dataset_path is None or os.path.exists(self.eval_dataset_path),
            f"{at}.eval_dataset_path = {self.eval_dataset_path!r}: no such file or folder",
        )


_SOURCE_NAME = re.compile(r"[A-Za-z0-9_-]+")


@dataclass(kw_only=True, slots=True)
class TaskSection(SourceSection):
    """The run's task: its own fields (one source), or a mixture in task.sources; and the
    rules that hold for every source."""

    sources: dict[str, WeightedSource] = field(default_factory=dict)
    """A weighted mixture of sources, [task.sources.NAME] tables with a task's fields plus
    weight and eval_dataset_path (the task's own fields then stay unset). Each source's
    figures are logged as reward/mean/NAME, response_length/mean/NAME, eval/accuracy/NAME.
    On the CLI: --task.sources.NAME.FIELD value (sources themselves come from the TOML)."""
    reward_on_error: Literal["zero", "fail"] = "zero"
    """When the reward function raises or times out: count and log it and give the sample 0,
    or stop."""
    reward_timeout_s: float = 30.0
    """Longest one reward call may take before it counts as failed (reward_on_error); 0
    disables the limit. Interrupts Python code (SIGALRM), so it works in the main thread."""
    env_timeout_s: float = 30.0
    """Longest one environment reset or step may take (an async step's await is cut); a step
    that times out or raises scores as task.reward_on_error says. An agent (task.name =
    agent) may work this long between its requests. 0: no limit."""
    gateway_host: str = "127.0.0.1"
    """Where the agents' gateway listens (task.name = agent), in the sessions' base URLs."""
    gateway_port: int = 0
    """The gateway's port; 0: any free one (each generator rank serves its own)."""

    @property
    def named_sources(self) -> dict[str, SourceSection]:
        """The run's sources by name: task.sources, or the task itself as the one source ""."""
        return dict(self.sources) if self.sources else {"": self}

    @property
    def most_turns(self) -> int:
        """Most assistant turns of an episode of any source."""
        return max(source.turns for source in self.named_sources.values())

    def validate(self) -> None:
        require(
            self.reward_timeout_s >= 0,
            f"task.reward_timeout_s = {self.reward_timeout_s}: must be >= 0 (0: no limit)",
        )
        require(
            self.env_timeout_s >= 0,
            f"task.env_timeout_s = {self.env_timeout_s}: must be >= 0 (0: no limit)",
        )
        require(
            0 <= self.gateway_port <= 65535,
            f"task.gateway_port = {self.gateway_port}: must be a TCP port, 0 to 65535 (0: any "
            "free one)",
        )
        if not self.sources:
            SourceSection.validate(self, "task")
            return
        own = {f.name: getattr(self, f.name) for f in fields(SourceSection)}
        changed = first_change(SourceSection(**own), SourceSection(), "task")
        if changed is not None:
            name, value = changed
            raise ConfigError(
                f"{name} = {value!r} is set beside task.sources: with a mixture every source "
                "holds its own fields; move it into each [task.sources.NAME] that needs it"
            )
        for name, source in self.sources.items():
            require(
                _SOURCE_NAME.fullmatch(name) is not None,
                f"task.sources.{name}: a source's name goes into metric names and CLI flags; "
                "use letters, digits, '_' and '-' only",
            )
            source.validate(f"task.sources.{name}")


@dataclass(kw_only=True, slots=True)
class EvalSection:
    dataset_path: str | None = None
    """Held-out dataset to evaluate on (as task.dataset_path, read with the task's keys, chat
    template and reward); None: no evaluation."""
    interval: int = 0
    """Evaluate every this many steps (and after the last); 0: only at the start and the end."""
    at_start: bool = True
    """Evaluate the starting policy before the first step (not when resuming)."""
    n: int = 1
    """Samples per prompt; eval/accuracy is their mean (mean@n), eval/pass@k for k = 1, 2, 4,
    ... <= n uses the unbiased estimator."""
    temperature: float = 0.0
    """Sampling temperature; 0 is greedy decoding (then n must be 1)."""
    max_tokens: int | None = None
    """Most tokens per completion; unset: generator.sampling.max_tokens."""
    log_samples: int = 4
    """Prompts, completions and rewards of this many prompts (of each source, in a mixture)
    written to eval.jsonl each time."""

    def validate(self) -> None:
        for name in ("interval", "log_samples"):
            require(getattr(self, name) >= 0, f"eval.{name} = {getattr(self, name)}: must be >= 0")
        require(self.n >= 1, f"eval.n = {self.n}: must be >= 1")
        require(self.temperature >= 0, f"eval.temperature = {self.temperature}: must be >= 0")
        require(
            self.temperature > 0 or self.n == 1,
            f"eval.n = {self.n} with eval.temperature = 0: greedy samples are all the same; "
            "set eval.n = 1, or a temperature > 0",
        )
        require(
            self.max_tokens is None or self.max_tokens >= 1,
            f"eval.max_tokens = {self.max_tokens}: must be >= 1",
        )
        require(
            self.dataset_path is None or os.path.exists(self.dataset_path),
            f"eval.dataset_path = {self.dataset_path!r}: no such file or folder",
        )
