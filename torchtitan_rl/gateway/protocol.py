"""The OpenAI chat API as the gateway speaks it: requests checked into sampling options, answers
built from a sampled turn, tool calls and reasoning parsed with vLLM's own parsers, errors in
OpenAI's format.

    .venv/bin/python -m pytest tests/unit/test_gateway.py
"""

import json
import logging
import time
from dataclasses import dataclass, field

from torchtitan_rl.gateway.session import text_of


class ApiError(Exception):
    """An error answered in OpenAI's format: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict:
        kind = {
            400: "invalid_request_error",
            401: "authentication_error",
            404: "not_found_error",
            503: "service_unavailable_error",
        }.get(self.status, "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": None}}


# Fields a client may send that change nothing here (sampling is the policy's): accepted.
_IGNORED = {
    "user",
    "metadata",
    "store",
    "parallel_tool_calls",
    "stream_options",
    "service_tier",
    "frequency_penalty",
    "presence_penalty",
    "response_format",
    "reasoning_effort",
    "skip_special_tokens",
}
_KNOWN = _IGNORED | {
    "model",
    "messages",
    "tools",
    "tool_choice",
    "n",
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "temperature",
    "top_p",
    "seed",
    "logprobs",
    "top_logprobs",
    "chat_template_kwargs",
    "stream",
    "return_token_ids",
    "prompt",
}


@dataclass(slots=True)
class ChatRequest:
    """A chat (or token-id completion) request, checked."""

    messages: list[dict] | None
    prompt_ids: list[int] | None = None
    """/v1/completions: the prompt as token ids."""
    tools: list[dict] | None = None
    tool_choice: str = "auto"
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    logprobs: bool = False
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False


def check_request(body, model: str, *, chat: bool, vocabulary: int) -> ChatRequest:
    """`body` (the request's JSON) checked: a 400 ApiError naming the field otherwise
    (`vocabulary`: the tokenizer's size, which a token-id prompt's ids must be under)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    body = {key: value for key, value in body.items() if value is not None}  # null: unset
    unknown = sorted(set(body) - _KNOWN)
    if unknown:
        raise ApiError(400, f"unknown parameter {unknown[0]!r}", unknown[0])
    if body.get("model") != model:
        raise ApiError(400, f"model {body.get('model')!r} is not served: use {model!r}", "model")
    if body.get("n", 1) != 1:
        raise ApiError(400, f"n = {body['n']!r}: the gateway samples one choice (n = 1)", "n")
    if body.get("top_logprobs"):
        raise ApiError(
            400,
            f"top_logprobs = {body['top_logprobs']!r}: the gateway returns the sampled token's "
            "logprob only (logprobs = true, top_logprobs = 0)",
            "top_logprobs",
        )
    request = ChatRequest(messages=None)
    if chat:
        request.messages = _messages(body.get("messages"))
        request.tools = _tools(body.get("tools"))
        choice = body.get("tool_choice", "auto")
        if choice not in ("auto", "none"):
            raise ApiError(
                400,
                f"tool_choice = {choice!r}: the gateway takes 'auto' or 'none' (the policy "
                "chooses its calls; a forced call would sample other tokens than the policy's)",
                "tool_choice",
            )
        request.tool_choice = choice
        if body.get("chat_template_kwargs"):
            raise ApiError(
                400,
                "chat_template_kwargs: the chat template's options are the run's "
                "(task.enable_thinking), so that every episode renders as training expects",
                "chat_template_kwargs",
            )
    else:
        request.prompt_ids = _token_ids(body.get("prompt"), vocabulary)
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    request.max_tokens = _number(limit, name, int, low=1)
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, "stop must be a string or a list of non-empty strings", "stop")
    request.stop = stop
    request.temperature = _number(body.get("temperature"), "temperature", float, low=0)
    request.top_p = _number(body.get("top_p"), "top_p", float, low=0, high=1)
    if request.top_p == 0:
        raise ApiError(400, "top_p = 0 keeps no token: use a value in (0, 1]", "top_p")
    request.seed = _number(body.get("seed"), "seed", int, low=0, high=2**63 - 1)
    request.logprobs = bool(body.get("logprobs", False))
    request.stream = bool(body.get("stream", False))
    options = body.get("stream_options") or {}
    request.include_usage = bool(isinstance(options, dict) and options.get("include_usage"))
    request.return_token_ids = bool(body.get("return_token_ids", False))
    return request


def _number(value, name: str, kind: type, low: float, high: float | None = None):
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or (kind is int and not isinstance(value, int))
    ):
        raise ApiError(
            400, f"{name} = {value!r}: must be a{'n integer' if kind is int else ' number'}", name
        )
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ApiError(400, f"{name} = {value!r}: must be {bound}", name)
    return kind(value)


def _messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list of messages", "messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a role", f"messages[{i}]")
        try:
            text_of(message.get("content"))
        except ValueError as e:
            raise ApiError(400, f"messages[{i}].content: {e}", f"messages[{i}].content") from None
    return messages


def _tools(tools) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(
        isinstance(t, dict) and isinstance(t.get("function"), dict) for t in tools
    ):
        raise ApiError(
            400, 'tools must be a list of {"type": "function", "function": {...}}', "tools"
        )
    return tools or None


def _token_ids(prompt, vocabulary: int) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]
    if (
        not isinstance(prompt, list)
        or not prompt
        or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        or not all(0 <= t < vocabulary for t in prompt)
    ):
        raise ApiError(
            400,
            f"prompt must be a non-empty list of token ids in [0, {vocabulary}) (the gateway "
            "does not encode text prompts: use /v1/chat/completions)",
            "prompt",
        )
    return prompt


def load_parsers(tokenizer, tool_parser: str | None, reasoning_parser: str | None, at: str):
    """The run's `Parsers`; a name vLLM does not know is one ConfigError line listing those it
    does."""
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    from torchtitan_rl.config import ConfigError

    tool_parser = None if tool_parser in (None, "", "none") else tool_parser
    for key, name, manager in (
        ("tool_parser", tool_parser, ToolParserManager),
        ("reasoning_parser", reasoning_parser, ReasoningParserManager),
    ):
        if name is not None and name not in manager.list_registered():
            raise ConfigError(
                f"{at}.{key} = {name!r} is not one of vLLM's: "
                f"{', '.join(sorted(manager.list_registered()))}"
            )
    return Parsers(tokenizer, tool_parser, reasoning_parser)


class Parsers:
    """vLLM's tool-call and reasoning parsers of the run (task.tool_parser,
    task.reasoning_parser), on the checkpoint's tokenizer."""

    def __init__(self, tokenizer, tool_parser: str | None, reasoning_parser: str | None):
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.reasoning import ReasoningParserManager
        from vllm.tool_parsers import ToolParserManager

        self.tokenizer = tokenizer
        self.tool = ToolParserManager.get_tool_parser(tool_parser) if tool_parser else None
        self.reasoning = None
        if reasoning_parser:
            self.reasoning = ReasoningParserManager.get_reasoning_parser(reasoning_parser)(
                tokenizer
            )
        self._request = ChatCompletionRequest
        marker = getattr(self.tool, "tool_call_start_token", None)
        self.keep_special = marker is not None and marker in tokenizer.all_special_tokens
        """The tool parser's marker is a special token of this tokenizer: its text must keep
        special tokens (as vLLM's parsers ask: `adjust_request`), or calls would vanish."""

    def text(self, token_ids: list[int], text: str, stop_ids: set[int]) -> str:
        """What the parsers read of a turn: `text` (decoded without special tokens), or, when
        the tool-call marker is one, the ids decoded with them (less a final stop id)."""
        if not self.keep_special:
            return text
        if token_ids and token_ids[-1] in stop_ids:
            token_ids = token_ids[:-1]
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    def message(self, text: str, request: ChatRequest) -> tuple[dict, int]:
        """The assistant message of a turn's `text`, and how many of its tool calls did not
        parse (returned as plain content)."""
        message: dict = {"role": "assistant", "content": text}
        if self.reasoning is not None:
            reasoning, content = self.reasoning.extract_reasoning(text, None)
            message["content"] = content or ""
            if reasoning is not None:
                message["reasoning_content"] = reasoning
        if self.tool is None or not request.tools or request.tool_choice == "none":
            return message, 0
        marker = getattr(self.tool, "tool_call_start_token", None)
        content = message["content"]
        vllm_request = self._request(messages=[], model="policy", tools=request.tools)
        # vLLM's Hermes parser logs a traceback for every call that is not JSON: here that is
        # the policy's mistake, counted (agent/ill_formed_tool_calls), not a server error. (Set
        # each time: vLLM's logging setup resets its loggers' levels when the engine starts.)
        quiet = logging.getLogger(self.tool.__module__)
        if quiet.level != logging.CRITICAL:  # setLevel clears every logger's cache: 0.4 ms
            quiet.setLevel(logging.CRITICAL)
        parsed = self.tool(self.tokenizer, request.tools).extract_tool_calls(content, vllm_request)
        if not parsed.tools_called:
            ill_formed = content.count(marker) if marker else 0
            return message, ill_formed
        message["content"] = parsed.content
        message["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": call.function.arguments},
            }
            for call in parsed.tool_calls
        ]
        return message, 0


def completion(
    name: str,
    model: str,
    *,
    chat: bool,
    message: dict,
    text: str,
    finish_reason: str,
    prompt_ids: list[int],
    token_ids: list[int],
    logprobs: list[float] | None,
    tokenizer,
    return_token_ids: bool,
) -> dict:
    """The non-streamed answer (chat.completion or text_completion) of a sampled turn."""
    choice: dict = {"index": 0, "finish_reason": finish_reason}
    if chat:
        choice["message"] = message
        choice["logprobs"] = _logprobs(token_ids, logprobs, tokenizer)
    else:
        choice["text"] = text
        choice["logprobs"] = None if logprobs is None else {"token_logprobs": logprobs}
    answer = {
        "id": name,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage(prompt_ids, token_ids),
    }
    if return_token_ids:
        answer["prompt_token_ids"] = prompt_ids
        choice["token_ids"] = token_ids
    return answer


def usage(prompt_ids: list[int], token_ids: list[int]) -> dict:
    return {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": len(token_ids),
        "total_tokens": len(prompt_ids) + len(token_ids),
    }


def _logprobs(token_ids: list[int], logprobs: list[float] | None, tokenizer) -> dict | None:
    if logprobs is None:
        return None
    tokens = [tokenizer.decode([i]) for i in token_ids]
    return {
        "content": [
            {"token": token, "logprob": logprob, "bytes": list(token.encode()), "top_logprobs": []}
            for token, logprob in zip(tokens, logprobs, strict=True)
        ]
    }


def chunk(name: str, model: str, delta: dict, finish_reason: str | None, **extra) -> bytes:
    """One server-sent event of a streamed chat answer."""
    body = {
        "id": name,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, **extra}],
    }
    return b"data: " + json.dumps(body).encode() + b"\n\n"
