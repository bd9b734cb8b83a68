"""Environments: the chat messages an episode exchanges with the model, one instance per episode.

.venv/bin/python -m pytest tests/*/test_envs.py

An environment speaks in messages, never in tokens: `reset(prompt)` gives the opening messages
(and the tool schemas the chat template shows), `step(assistant_message)` answers one assistant
turn with environment messages (tool results, a user's reply), whether the episode is done,
and a reward that adds to the episode's. Tokens are the episode runner's business
(`tasks.episodes`), which never re-encodes what the model sampled.

A single-turn task is the one-step case (`SingleTurn`): its step takes the answer and ends;
the episode runner scores the answers.
A user environment is any class with these two coroutines, named `module:Class` in
`task.env` and built once per episode with `task.env_kwargs`.
"""

import ast
import json
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from torchtitan_rl.config import ConfigError
from torchtitan_rl.config.manager import import_spec
from torchtitan_rl.tasks.rewards import math_reward
from torchtitan_rl.types import Prompt


@dataclass(frozen=True, slots=True)
class EnvStep:
    """An environment's answer to one assistant turn."""

    messages: list[dict]
    """Messages rendered after the assistant's turn ({"role": "tool" or "user", "content"});
    the model's next turn follows them. Ignored when `done`. For a vision-language model, a
    content may be a list of parts that shows images: {"type": "text", "text": ...} and
    {"type": "image", "image": <PIL image, path, data URL or bytes>}; the model sees each image
    from then on."""
    done: bool
    reward: float = 0.0
    """Added to the episode's reward (an episode's reward is the sum over its steps)."""
    tool_calls: int = 0
    """Tool calls the assistant turn made (well-formed or not), for the metrics."""
    tool_errors: int = 0
    """Of those, the malformed ones and the ones whose tool failed."""


class Environment(Protocol):
    async def reset(self, prompt: Prompt) -> tuple[list[dict], list[dict] | None]:
        """The episode's opening messages for dataset row `prompt`, and the tools (JSON schemas
        for the chat template's `tools=`) or None. The episodes of one prompt's group must
        open alike."""
        ...

    async def step(self, message: dict) -> EnvStep:
        """Answer the assistant's turn `message` ({"role": "assistant", "content": text})."""
        ...


class SingleTurn:
    """A single-turn task as an environment: the prompt's messages, one answer. The episode
    runner scores a step's answers together (`Scorer.score`: batched and async reward
    functions), so the step itself gives no reward."""

    def __init__(self):
        self.answer: str | None = None

    async def reset(self, prompt: Prompt) -> tuple[list[dict], None]:
        return list(prompt.messages or [{"role": "user", "content": prompt.text}]), None

    async def step(self, message: dict) -> EnvStep:
        self.answer = message["content"]
        return EnvStep([], done=True)


def load_env(spec: str, kwargs: dict, at: str = "task") -> Callable[[], Environment]:
    """A factory of the environment class named 'package.module:Class', built with `kwargs`
    (the env_kwargs of section `at`: task or task.sources.NAME); one ConfigError line if it
    does not import or does not take them."""
    cls = import_spec(spec, f"{at}.env", "class")
    for name in ("reset", "step"):
        if not callable(getattr(cls, name, None)):
            raise ConfigError(
                f"{at}.env = {spec!r}: {cls.__name__} has no {name}() method; an environment "
                "has async reset(prompt) and step(message) (see tasks/env.py)"
            )
    try:
        cls(**kwargs)
    except Exception as e:  # a wrong keyword, a bad value: the user's constructor says which
        raise ConfigError(
            f"{at}.env_kwargs = {kwargs!r}: {cls.__name__}(**{at}.env_kwargs) raised {e!r}"
        ) from None
    return lambda: cls(**kwargs)


# Tool calls, in the Qwen3 / Hermes format the chat templates of both families write:
#   <tool_call>
#   {"name": "calc", "arguments": {"expression": "max(3,7)"}}
#   </tool_call>
_TOOL_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: dict
    error: str | None = None
    """Why the call is malformed (then name and arguments are empty), else None."""


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The tool calls in an assistant turn's text, in order; a malformed one (unclosed, not
    JSON, no name) is a ToolCall with `error` set: the model's mistake, never an exception."""
    calls = []
    for body, close in _TOOL_CALL.findall(text):
        if not close:
            calls.append(ToolCall("", {}, "the <tool_call> is not closed by </tool_call>"))
            continue
        try:
            value = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(ToolCall("", {}, f"the tool call is not JSON ({e.msg})"))
            continue
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            calls.append(ToolCall("", {}, 'the tool call needs a "name"'))
            continue
        arguments = value.get("arguments", {})
        if not isinstance(arguments, dict):
            calls.append(ToolCall("", {}, '"arguments" must be an object'))
            continue
        calls.append(ToolCall(value["name"], arguments))
    return calls


class ToolEnv:
    """Base of tool-using environments: the row's question as the user's message; an assistant
    turn with tool calls gets one tool message per call (the result, or "error: ..." for a
    malformed call, an unknown tool or a tool that raised); a turn without calls is the final
    answer, rewarded by `reward` and ending the episode."""

    tools: dict[str, Callable[..., str]] = {}
    """Tool name -> the function run with the call's arguments; returns the reply text."""
    schemas: list[dict] | None = None
    """The tools' JSON schemas, for chat templates that show them (`tools=`)."""

    async def reset(self, prompt: Prompt) -> tuple[list[dict], list[dict] | None]:
        self.prompt = prompt
        return list(prompt.messages or [{"role": "user", "content": prompt.text}]), self.schemas

    async def step(self, message: dict) -> EnvStep:
        calls = parse_tool_calls(message["content"])
        if not calls:
            return EnvStep([], done=True, reward=self.reward(message["content"]))
        replies, errors = [], 0
        for call in calls:
            reply = self.run(call)
            errors += reply.startswith("error:")
            replies.append({"role": "tool", "content": reply})
        return EnvStep(replies, done=False, tool_calls=len(calls), tool_errors=errors)

    def run(self, call: ToolCall) -> str:
        """The reply to one call; "error: ..." when it cannot be answered."""
        if call.error is not None:
            return f"error: {call.error}"
        tool = self.tools.get(call.name)
        if tool is None:
            return f"error: no tool {call.name!r}"
        try:
            return str(tool(**call.arguments))
        except Exception as e:  # the model's arguments: any failure is the model's mistake
            return f"error: {e}"

    def reward(self, answer: str) -> float:
        raise NotImplementedError


_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
_FUNCTIONS = {"max": max, "min": min}


def calc(expression: str) -> str:
    """Integer arithmetic: + - * and max(a, b), min(a, b); ValueError on anything else."""

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in _FUNCTIONS
            and node.args
            and not node.keywords
        ):
            return _FUNCTIONS[node.func.id](value(a) for a in node.args)
        raise ValueError(f"cannot evaluate {expression!r}")

    if not isinstance(expression, str) or len(expression) > 64:
        raise ValueError("expression must be a string of at most 64 characters")
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot parse {expression!r}") from None
    return str(value(tree.body))


class Calculator(ToolEnv):
    """The arithmetic rows with a `calc` tool: the model may call it, then answers; the answer
    scores 1.0 when it is the row's answer (`rewards.math_reward`)."""

    tools = {"calc": calc}
    schemas = [
        {
            "type": "function",
            "function": {
                "name": "calc",
                "description": "evaluate integer arithmetic: + - * max min",
                "parameters": {
                    "type": "object",
                    "properties": {"expression": {"type": "string"}},
                    "required": ["expression"],
                },
            },
        }
    ]

    def reward(self, answer: str) -> float:
        return math_reward(self.prompt.text, answer, self.prompt.answer)
