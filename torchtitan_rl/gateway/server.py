"""The gateway: an OpenAI-compatible HTTP server over the generator, one session per episode.

    .venv/bin/python -m pytest tests/integration/test_gateway.py

Each episode of an agent task gets a session: its base URL `http://HOST:PORT/s/{session}/v1`
and key, which any OpenAI client takes as `base_url` and `api_key`. Routes, per session:
`GET /v1/models`, `POST /v1/chat/completions` (n = 1, streamed or not), `POST /v1/completions`
with a token-id prompt, and `POST /rl/reward` ({"reward": float}) and `POST /rl/end` for
agents that report their own reward. Each turn is recorded token-exact by the session
(gateway/session.py) and sampled through the episode's driver: the engine's request stream,
turn by turn in colocated and disaggregated placement (`Lockstep`), free-running in continuous
placement (stream.AsyncStream).

The server (FastAPI on uvicorn) runs on the event loop that runs the episodes: a request is
read and answered between engine steps, and the agents of the process (`task.agent`) are
coroutines on the same loop. Errors answer in OpenAI's format: 400 naming the field, 401 a
wrong key, 404 an unknown or ended session, 500 anything else. A client that disconnects aborts
its request in the engine.
"""

import asyncio
import contextlib
import json
import secrets
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from torchtitan_rl.gateway.protocol import (
    ApiError,
    ChatRequest,
    Parsers,
    check_request,
    chunk,
)
from torchtitan_rl.gateway.protocol import completion as completion_body
from torchtitan_rl.gateway.session import BadPart, Session, Turn
from torchtitan_rl.types import Sample

MODEL = "policy"
"""The model name the gateway serves (`GET /v1/models`); agents receive it."""

Sampler = Callable[..., Awaitable[Sample]]
"""A driver's `sample(order, prompt_ids, *, seed, max_tokens, temperature, **options)`."""


@dataclass(slots=True)
class Opened:
    """A session open on the gateway: one episode's."""

    name: str
    """Its path, /s/{name}/v1."""
    session: Session
    parsers: Parsers
    key: str
    seed: int
    """The episode's seed: turn t samples with seed `turn_seed(seed, t)` unless the client
    gives one."""
    order: int
    """The episode's place in its batch (Lockstep submits each batch in this order)."""
    sample: Sampler
    max_turns: int
    reward: float | None = None
    """What the agent reported on /rl/reward."""
    ill_formed_tool_calls: int = 0
    tool_calls: int = 0
    in_flight: int = 0
    idle_since: float = field(default_factory=time.monotonic)
    waited_s: float = 0.0
    """Seconds with a request in flight."""


def turn_seed(seed: int, turn: int) -> int:
    """The seed of an episode's turn, as `Episodes` seeds an environment's turns."""
    return seed if turn == 0 else (seed * 1_000_003 + turn) % 2**62


class Gateway:
    """The HTTP server and its sessions (see the module docstring)."""

    def __init__(
        self,
        *,
        stop_ids: set[int],
        max_model_len: int,
        host: str = "127.0.0.1",
        port: int = 0,
    ):
        """`host`, `port` (0: any free one): where to serve."""
        self.stop_ids, self.max_model_len = stop_ids, max_model_len
        self.host, self.port = host, port
        self.sessions: dict[str, Opened] = {}
        self.app = self._app()
        self._server = None
        self._loop = self._sock = None
        self._count = 0

    async def start(self) -> None:
        """Serve on the running event loop (again, if the loop is another than before)."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # the first of the episodes (continuous: groups) starting
            self._loop, self._started = loop, loop.create_task(self._serve(loop))
        await asyncio.shield(self._started)

    async def _serve(self, loop) -> None:
        import uvicorn

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):  # the run's own SIGTERM handler stays (preemption)
                yield

        config = uvicorn.Config(
            self.app,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_keep_alive=3600,  # an agent's connection idles while its tools run
        )
        self._server = Server(config)
        # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets whose protocol says
        # TCP, and without it every answer (uvicorn writes its head and body apart) waited for
        # the client's delayed ACK: 44 ms a request, measured.
        if self._sock is not None:
            self._sock.close()  # the server of a loop that is gone
        sock = self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        self._task = loop.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # the server's failure, raised
            await asyncio.sleep(0.001)

    def open(
        self,
        renderer,
        parsers: Parsers,
        *,
        seed: int,
        order: int,
        sample: Sampler,
        max_turns: int,
    ) -> tuple[str, Opened]:
        """A new session of an episode rendered by `renderer` (its source's), its turns
        sampled by `sample`: its base URL and its state."""
        self._count += 1
        name = f"{self._count}-{secrets.token_hex(4)}"
        opened = Opened(
            name,
            Session(renderer, self.stop_ids),
            parsers,
            key=secrets.token_hex(16),
            seed=seed,
            order=order,
            sample=sample,
            max_turns=max_turns,
        )
        self.sessions[name] = opened
        return f"http://{self.host}:{self.port}/s/{name}/v1", opened

    def close(self, opened: Opened) -> None:
        """End a session: its URL answers 404 from now on."""
        self.sessions.pop(opened.name, None)

    def _session(self, name: str, authorization: str | None) -> Opened:
        opened = self.sessions.get(name)
        if opened is None:
            raise ApiError(404, f"no session {name!r} (it ended, or never was)")
        if authorization != f"Bearer {opened.key}":
            raise ApiError(401, "wrong API key for this session: use the key it was opened with")
        return opened

    def _app(self):
        from fastapi import FastAPI, Request
        from fastapi.responses import JSONResponse, StreamingResponse

        app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

        @app.exception_handler(ApiError)
        async def api_error(request: Request, error: ApiError):
            return JSONResponse(error.body(), status_code=error.status)

        @app.exception_handler(Exception)
        async def server_error(request: Request, error: Exception):
            # The engine's or the gateway's failure, in OpenAI's format (its SDK reads it).
            body = ApiError(500, f"the gateway failed: {error!r}").body()
            return JSONResponse(body, status_code=500)

        @app.get("/s/{name}/v1/models")
        async def models(name: str, request: Request):
            self._session(name, request.headers.get("authorization"))
            model = {"id": MODEL, "object": "model", "created": 0, "owned_by": "torchtitan_rl"}
            return {"object": "list", "data": [model]}

        @app.post("/s/{name}/v1/chat/completions")
        async def chat(name: str, request: Request):
            return await self._answer(name, request, chat=True)

        @app.post("/s/{name}/v1/completions")
        async def completions(name: str, request: Request):
            return await self._answer(name, request, chat=False)

        @app.post("/s/{name}/rl/reward")
        async def reward(name: str, request: Request):
            opened = self._session(name, request.headers.get("authorization"))
            body = await _json(request)
            value = body.get("reward") if isinstance(body, dict) else None
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ApiError(400, 'the body must be {"reward": number}', "reward")
            opened.reward = float(value)
            return {"ok": True}

        @app.post("/s/{name}/rl/end")
        async def end(name: str, request: Request):
            self.close(self._session(name, request.headers.get("authorization")))
            return {"ok": True}

        self._streaming, self._json_response = StreamingResponse, JSONResponse
        return app

    async def _answer(self, name: str, request, *, chat: bool):
        opened = self._session(name, request.headers.get("authorization"))
        asked = check_request(
            await _json(request),
            MODEL,
            chat=chat,
            vocabulary=len(opened.session.renderer.tokenizer),
        )
        if opened.session.asked >= opened.max_turns:
            raise ApiError(
                400,
                f"the session's {opened.max_turns} turns (task.max_turns) are spent: end the "
                "episode",
                "messages",
            )
        if asked.messages is not None:
            await asyncio.to_thread(opened.session.read_images, asked.messages)
        turn, sampling = self._turn(opened, asked)
        opened.session.asked += 1
        if opened.in_flight == 0:
            opened.idle_since = time.monotonic()
        opened.in_flight += 1
        queue: asyncio.Queue | None = asyncio.Queue() if asked.stream else None
        if queue is not None:
            sampling["listener"] = queue.put_nowait
        task = asyncio.ensure_future(opened.sample(opened.order, turn.prompt_ids, **sampling))
        task.add_done_callback(lambda _: _idle(opened))
        if asked.stream:
            return self._streaming(
                self._stream(opened, turn, asked, task, queue), media_type="text/event-stream"
            )
        try:
            sample = await _unless_disconnected(task, request)
        except asyncio.CancelledError:
            # The event loop ends with the run (continuous placement drops the groups in
            # flight): answer rather than leave uvicorn a cancelled handler to log.
            raise ApiError(503, "the run is ending: this episode was dropped") from None
        return self._json_response(self._record(opened, turn, asked, sample, chat))

    def _turn(self, opened: Opened, asked: ChatRequest) -> tuple[Turn, dict]:
        """The request's turn in its session and its sampling options."""
        session = opened.session
        if asked.messages is not None:
            try:
                turn = session.prompt(asked.messages, asked.tools)
            except BadPart as e:  # an image the policy cannot read
                raise ApiError(400, str(e), e.param) from None
            except Exception as e:  # a chat template raising on the client's messages
                raise ApiError(
                    400, f"messages do not render with the chat template: {e}", "messages"
                ) from None
        else:
            turn = Turn(
                session.segments[-1] if session.segments else None, asked.prompt_ids, [], [], True
            )
        room = self.max_model_len - len(turn.prompt_ids)
        if room <= 0:
            raise ApiError(
                400,
                f"the prompt has {len(turn.prompt_ids)} tokens, generator.max_model_len = "
                f"{self.max_model_len} leaves no room to generate: shorten the conversation",
                "messages" if asked.messages is not None else "prompt",
            )
        sampling = {
            "seed": turn_seed(opened.seed, session.asked) if asked.seed is None else asked.seed,
            "max_tokens": asked.max_tokens,
            "room": room,
            "temperature": asked.temperature,
        }
        if asked.top_p is not None:
            sampling["top_p"] = asked.top_p
        if asked.stop:
            sampling["stop"] = asked.stop
        if turn.images is not None:
            sampling["images"] = turn.images
        return turn, sampling

    def _record(
        self, opened: Opened, turn: Turn, asked: ChatRequest, sample: Sample, chat: bool
    ) -> dict:
        """Record the sampled turn; its answer's body."""
        renderer = opened.session.renderer
        text = renderer.decode(sample.token_ids)
        finish = sample.finish_reason
        if chat:
            read = _cut(opened.parsers.text(sample.token_ids, text, self.stop_ids), asked.stop)
            message, ill_formed = opened.parsers.message(read, asked)
            opened.ill_formed_tool_calls += ill_formed
            opened.tool_calls += len(message.get("tool_calls", ())) + ill_formed
            if message.get("tool_calls") and finish == "stop":
                finish = "tool_calls"
            opened.session.record(turn, sample, text, message, ill_formed)
        else:
            message = {}  # a token-id completion is sampled, not recorded
        return completion_body(
            f"chatcmpl-{opened.session.asked}" if chat else f"cmpl-{opened.session.asked}",
            MODEL,
            chat=chat,
            message=message,
            text=text,
            finish_reason=finish,
            prompt_ids=turn.prompt_ids,
            token_ids=sample.token_ids,
            logprobs=sample.logprobs if asked.logprobs else None,
            tokenizer=renderer.tokenizer,
            return_token_ids=asked.return_token_ids,
        )

    async def _stream(self, opened, turn, asked, task, queue):
        """The server-sent events of a streamed chat answer: the text as it is sampled (with
        tools or a reasoning parser, the parsed message once the turn is done), then the
        finish, the usage (stream_options.include_usage) and [DONE]."""
        name = f"chatcmpl-{opened.session.asked}"
        parsers = opened.parsers
        plain = parsers.reasoning is None and not (asked.tools and parsers.tool)
        try:
            yield chunk(name, MODEL, {"role": "assistant", "content": ""}, None)
            ids, sent = [], ""
            while not task.done() or not queue.empty():
                getter = asyncio.ensure_future(queue.get())
                await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    continue
                ids += getter.result()
                # A token that ends inside a character decodes to U+FFFD: held back until the
                # character is whole.
                text = opened.session.renderer.decode(ids).rstrip("\ufffd")
                if plain and text.startswith(sent) and len(text) > len(sent):
                    yield chunk(name, MODEL, {"content": text[len(sent) :]}, None)
                    sent = text
            try:
                body = self._record(opened, turn, asked, task.result(), chat=True)
            except Exception as e:  # the engine's failure, after the 200 went out
                error = ApiError(500, f"the gateway failed: {e!r}").body()
                yield b"data: " + json.dumps(error).encode() + b"\n\n"
                return
            message, choice = body["choices"][0]["message"], body["choices"][0]
            delta = {k: v for k, v in message.items() if k not in ("role", "content")}
            rest = message.get("content") or ""
            if plain and rest.startswith(sent):
                rest = rest[len(sent) :]
            if rest:
                delta["content"] = rest
            if "tool_calls" in delta:
                delta["tool_calls"] = [{**c, "index": i} for i, c in enumerate(delta["tool_calls"])]
            extra = {"logprobs": choice["logprobs"]}
            if asked.return_token_ids:
                extra["token_ids"] = choice["token_ids"]
            yield chunk(name, MODEL, delta, choice["finish_reason"], **extra)
            if asked.include_usage:
                final = {
                    "id": name,
                    "object": "chat.completion.chunk",
                    "created": body["created"],
                    "model": MODEL,
                    "choices": [],
                    "usage": body["usage"],
                }
                yield b"data: " + json.dumps(final).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"
        except asyncio.CancelledError:
            return  # the client went away, or the run ends: the stream just stops
        finally:
            if not task.done():
                task.cancel()  # the client went away: its request leaves the engine


def _cut(text: str, stops: list[str]) -> str:
    """`text` before the first of the client's stop strings (OpenAI leaves them out; the
    trained ids keep them, as sampled)."""
    ends = [text.find(stop) for stop in stops if stop in text]
    return text[: min(ends)] if ends else text


def _idle(opened: Opened) -> None:
    opened.in_flight -= 1
    if opened.in_flight == 0:
        now = time.monotonic()
        opened.waited_s += now - opened.idle_since
        opened.idle_since = now


async def _json(request):
    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not JSON ({e})") from None


async def _unless_disconnected(task: asyncio.Future, request) -> Sample:
    """The sample of `task`; cancelled (its engine request aborted) if the client disconnects
    first."""

    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()  # the client went away (or the server stops): free the engine
    if task.cancelled():
        raise ApiError(499, "the client disconnected")
    return task.result()
