"""The gateway on the real vLLM engine with the real `openai` client over HTTP: what
tests/integration/test_gateway.py checks, run by tests/dist/stream_run.py on its engine (one
engine start for both).

The engine is stepped as continuous placement steps it (an AsyncStream, a step whenever a
request is in flight). A random model rarely samples <|im_end|>: turns end at max_tokens.
"""

import asyncio
import statistics
import time

import httpx
import openai
from helpers.launch import REPO

from torchtitan_rl.config import TaskSection
from torchtitan_rl.episodes import _defaults
from torchtitan_rl.gateway.protocol import load_parsers
from torchtitan_rl.gateway.server import Gateway
from torchtitan_rl.generator.engine import LocalGenerator
from torchtitan_rl.generator.stream import AsyncStream, RequestStream
from torchtitan_rl.models import checkpoint_stop_ids
from torchtitan_rl.tasks.render import build_renderer

TINY = str(REPO / "assets" / "tiny_qwen3")
MAX_TOKENS = 8


async def drive(stream: AsyncStream) -> None:
    while True:
        if len(stream.stream):
            stream.step()
            await asyncio.sleep(0)
        else:
            await asyncio.sleep(0.001)


async def gateway_checks(generator: LocalGenerator, max_model_len: int) -> dict:
    """The checks, on `generator` (tiny Qwen3, generator.max_model_len = `max_model_len`, no
    stop strings), as a dict of what they saw."""
    stream = AsyncStream(RequestStream(generator))
    stepping = asyncio.ensure_future(drive(stream))
    gateway = Gateway(stop_ids=set(checkpoint_stop_ids(TINY)), max_model_len=max_model_len)
    await gateway.start()
    task = TaskSection(name="agent", agent="x:y", dataset_path=str(REPO / "data"))
    renderer = build_renderer(task, TINY, max_prompt_len=64)
    parsers = load_parsers(renderer.tokenizer, "hermes", None, "task")
    sample = _defaults(lambda _, *a, **k: stream.sample(*a, **k), None, MAX_TOKENS)
    http = httpx.AsyncClient(timeout=None)

    def session(seed: int):
        url, opened = gateway.open(
            renderer, parsers, seed=seed, order=0, sample=sample, max_turns=8
        )
        client = openai.AsyncOpenAI(
            base_url=url, api_key=opened.key, http_client=http, max_retries=0
        )
        return client, opened

    out = {"base_url": url_of(gateway)}
    user = [{"role": "user", "content": "max(3,7)="}]
    ids = {"return_token_ids": True}

    # Two turns; the recorded ids against the engine's own sample of the same prompt and seed.
    client, opened = session(seed=5)
    first = await client.chat.completions.create(
        model="policy", messages=user, logprobs=True, extra_body=ids
    )
    message = first.choices[0].message.model_dump(exclude_none=True)
    second = await client.chat.completions.create(
        model="policy",
        messages=[*user, message, {"role": "tool", "content": "go on"}],
        extra_body=ids,
    )
    direct = generator.generate([first.prompt_token_ids], n=1, seed=5, max_tokens=MAX_TOKENS)
    direct2 = generator.generate(
        [second.prompt_token_ids], n=1, seed=(5 * 1_000_003 + 1) % 2**62, max_tokens=MAX_TOKENS
    )
    (segment,) = opened.session.segments
    out["turns"] = {
        "first_prompt": first.prompt_token_ids,
        "first_ids": first.choices[0].token_ids,
        "first_logprobs": [c.logprob for c in first.choices[0].logprobs.content],
        "first_usage": first.usage.model_dump(),
        "second_prompt": second.prompt_token_ids,
        "second_ids": second.choices[0].token_ids,
        "direct_ids": direct.samples[0][0].token_ids,
        "direct_logprobs": direct.samples[0][0].logprobs,
        "direct2_ids": direct2.samples[0][0].token_ids,
        "recorded_first": segment.first_ids,
        "recorded_ids": segment.token_ids,
        "recorded_mask": segment.sampled_mask,
        "content": first.choices[0].message.content,
        "decoded": renderer.decode(first.choices[0].token_ids),
    }

    # Streaming gives the non-streamed answer (a new session: the same seed, the same turn).
    client, _ = session(seed=5)
    chunks = [
        c
        async for c in await client.chat.completions.create(
            model="policy",
            messages=user,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=ids,
        )
    ]
    out["stream"] = {
        "content": "".join(c.choices[0].delta.content or "" for c in chunks if c.choices),
        "chunks": len(chunks),
        "token_ids": [c.choices[0].model_extra.get("token_ids") for c in chunks if c.choices][-1],
        "usage": chunks[-1].usage.model_dump(),
    }

    # 32 concurrent sessions, each its own prompt: every answer is its session's.
    async def one(i: int):
        client, opened = session(seed=100 + i)
        prompt = [{"role": "user", "content": f"max({i},{i + 1})="}]
        began = time.perf_counter()
        answer = await client.chat.completions.create(
            model="policy", messages=prompt, stream=True, extra_body=ids
        )
        chunks = [c async for c in answer]
        spent = time.perf_counter() - began
        token_ids = [c.choices[0].model_extra.get("token_ids") for c in chunks][-1]
        recorded = opened.session.segments[0]
        own = renderer.chat(prompt, None, generation_prompt=True)
        return {
            "mine": recorded.token_ids == token_ids
            and recorded.first_ids == renderer.tokenizer.encode(own, add_special_tokens=False),
            "spent": spent,
        }

    many = await asyncio.gather(*(one(i) for i in range(32)))
    spent = sorted(m["spent"] for m in many)
    out["concurrent"] = {
        "mine": [m["mine"] for m in many],
        "p50_ms": 1000 * statistics.median(spent),
    }

    # A client that disconnects aborts its request; a version bump mid-turn tags the tokens.
    client, opened = session(seed=9)
    raw = httpx.AsyncClient(timeout=None)
    body = {"model": "policy", "messages": user, "stream": True, "max_tokens": 100}
    request = raw.build_request(
        "POST",
        f"{url_of(gateway)}/s/{opened.name}/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {opened.key}"},
    )
    response = await raw.send(request, stream=True)
    lines = response.aiter_lines()
    while True:
        if (await lines.__anext__()).startswith("data: "):
            break
    in_flight = len(stream.stream)
    await response.aclose()
    await raw.aclose()
    for _ in range(200):
        await asyncio.sleep(0.01)
        if not len(stream.stream):
            break
    out["disconnect"] = {
        "in_flight_before": in_flight,
        "in_flight_after": len(stream.stream),
        "engine_unfinished": generator.engine.has_unfinished_requests(),
    }

    client, opened = session(seed=11)
    version = generator.policy_version

    async def bump():
        while not any(live.token_ids for live in stream.stream.live.values()):
            await asyncio.sleep(0)
        generator.policy_version = version + 1  # what a weight update between steps sets

    bumping = asyncio.ensure_future(bump())
    await client.chat.completions.create(model="policy", messages=user, max_tokens=12)
    await bumping
    generator.policy_version = version
    out["versions"] = [v - version for v in opened.session.segments[0].versions]

    # A prompt over generator.max_model_len: 400 naming the field, before the engine.
    client, _ = session(seed=1)
    try:
        await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "9" * (max_model_len + 50)}]
        )
    except openai.BadRequestError as e:
        out["too_long"] = [e.status_code, e.message]
    stepping.cancel()
    return out


def url_of(gateway: Gateway) -> str:
    return f"http://{gateway.host}:{gateway.port}"
