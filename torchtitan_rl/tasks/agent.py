"""Agents: programs that drive an episode themselves, through an OpenAI-compatible endpoint (the
gateway, torchtitan_rl/gateway), instead of answering the model as environments do.

    .venv/bin/python -m pytest tests/integration/test_gateway.py

`task.name = "agent"` runs one agent per episode on the rows of task.dataset_path:

- `task.agent = "module:function"`: `async def function(client, model, row) -> float | None`,
  called with an `openai.AsyncOpenAI` client of the episode's session, the model name to ask
  for, and the row (`row_of`). It returns the episode's reward, or None to have the task's
  reward function score the final assistant message.
- `task.agent_url`: an agent server outside the process (any language, a container), called
  `POST {agent_url}` with {"base_url", "api_key", "model", "row"}; it answers {"reward": float
  or null} (or the bare number) once its episode is done.

Either may also report the reward on `POST {base_url}/../rl/reward`. The tokens trained on are
what the gateway recorded, never what the agent says it saw.
"""

import functools
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from torchtitan_rl.config import ConfigError
from torchtitan_rl.config.manager import import_spec
from torchtitan_rl.types import Prompt
from torchtitan_rl.vision.preprocess import data_url


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where an episode's agent talks to the policy."""

    base_url: str
    api_key: str
    model: str


Agent = Callable[[Endpoint, dict], Awaitable[float | None]]
"""Runs one episode against `Endpoint` on a row; its reward or None."""


def row_of(prompt: Prompt, messages: list[dict]) -> dict:
    """What an agent gets of its dataset row: the prompt text, the answer, the opening chat
    messages as the task renders them (the system prompt included; images as OpenAI's
    `image_url` parts with data URLs, which the gateway takes), and where the row is."""
    try:
        messages = [_with_data_urls(message) for message in messages]
    except ValueError as e:  # a row's bad image
        raise ConfigError(f"{prompt.row}: {e}") from None
    return {"prompt": prompt.text, "answer": prompt.answer, "messages": messages, "row": prompt.row}


def _with_data_urls(message: dict) -> dict:
    """`message` with each image part an `image_url` part of the image's data URL."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    parts = []
    for part in content:
        if part.get("type") in ("image", "image_url"):
            image = part.get("image", part.get("image_url"))
            image = image.get("url") if isinstance(image, dict) else image
            part = {"type": "image_url", "image_url": {"url": data_url(image)}}
        parts.append(part)
    return {**message, "content": parts}


def load_agent(function: str | None, url: str | None, at: str = "task") -> Agent:
    """The agent of `{at}.agent` (a coroutine function) or `{at}.agent_url`."""
    if url is not None:
        return _http_agent(url)
    found = import_spec(function, f"{at}.agent", "function")
    if not inspect.iscoroutinefunction(found):
        raise ConfigError(
            f"{at}.agent = {function!r}: {found.__name__} is not a coroutine function; write "
            "it as `async def agent(client, model, row) -> float | None`"
        )

    async def run(endpoint: Endpoint, row: dict) -> float | None:
        import openai

        client = openai.AsyncOpenAI(
            base_url=endpoint.base_url,
            api_key=endpoint.api_key,
            max_retries=0,
            timeout=None,
            http_client=_http_client(),
        )
        async with client:
            return await found(client, endpoint.model, row)

    return run


def _http_agent(url: str) -> Agent:
    async def run(endpoint: Endpoint, row: dict) -> float | None:

        body = {
            "base_url": endpoint.base_url,
            "api_key": endpoint.api_key,
            "model": endpoint.model,
            "row": row,
        }
        async with _http_client() as http:
            answer = await http.post(url, json=body)
        if answer.status_code != 200:
            raise RuntimeError(
                f"task.agent_url {url} answered {answer.status_code}: {answer.text:.200}"
            )
        value = answer.json()
        if isinstance(value, dict):
            value = value.get("reward")
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise RuntimeError(
                f"task.agent_url {url} answered reward {value!r}, not a number or null"
            )
        return None if value is None else float(value)

    return run


def _http_client():
    """An HTTP client for one episode's agent. Each has its own connection pool: one pool
    shared by 64 concurrent sessions made httpcore's connection assignment (quadratic in the
    pool's connections) most of a step (measured). They share one TLS context, whose creation
    was the cost of a client (19 ms of the 19.3)."""
    import httpx

    return httpx.AsyncClient(verify=_tls(), timeout=None)


@functools.cache
def _tls():
    import ssl

    return ssl.create_default_context()
