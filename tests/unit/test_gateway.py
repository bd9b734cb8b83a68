"""The gateway's HTTP API and its token-exact recording, with the real `openai` client
(`AsyncOpenAI`) on the real FastAPI app, in process (httpx's ASGI transport), and a scripted
policy: a random tiny model never writes a tool call or a <think> block, so each test scripts
the text its turns sample (their ids as the tokenizer encodes them, then <|im_end|>). The real
engine behind the gateway: tests/integration/test_gateway.py.

    .venv/bin/python -m pytest tests/unit/test_gateway.py
"""

import asyncio
import base64
import json

import httpx
import numpy as np
import openai
import PIL.Image
import pytest
import torch
from helpers.render import chatter_renderer, encode, same_images, vision_renderer

from torchtitan_rl.config import ConfigError, TaskSection
from torchtitan_rl.episodes import Episode, _defaults, _shared_prompt, _take
from torchtitan_rl.gateway.protocol import load_parsers
from torchtitan_rl.gateway.server import Gateway
from torchtitan_rl.tasks.agent import row_of
from torchtitan_rl.tasks.env import Calculator
from torchtitan_rl.types import Prompt, Sample, rollout_batch
from torchtitan_rl.vision.preprocess import data_url

IM_END = 4
CALL = '<tool_call>\n{"name": "calc", "arguments": {"expression": "max(3,7)"}}\n</tool_call>'
USER = [{"role": "user", "content": "max(3,7)="}]


class Script:
    """A policy that samples the texts it is given, in order; each request it got is kept."""

    def __init__(self, renderer, texts: list[str]):
        self.renderer, self.texts = renderer, list(texts)
        self.requests: list[tuple[list[int], dict]] = []

    async def sample(self, order, prompt_ids, **options) -> Sample:
        self.requests.append((list(prompt_ids), options))
        ids = encode(self.renderer, self.texts.pop(0)) + [IM_END]
        await asyncio.sleep(0)  # as an engine step would: other requests go on meanwhile
        listener = options.get("listener")
        if listener is not None:
            for i in range(0, len(ids), 3):  # a few tokens per engine step
                listener(ids[i : i + 3])
                await asyncio.sleep(0)
        return Sample(ids, [-0.5] * len(ids), "stop", versions=[3] * len(ids))


@pytest.fixture(scope="module")
def renderer():
    return chatter_renderer()


def serve(renderer, texts, *, max_turns=8, max_model_len=512, reasoning=None):
    """A gateway session of a scripted policy: (client, opened session, script, gateway)."""
    gateway = Gateway(stop_ids={IM_END}, max_model_len=max_model_len)
    parsers = load_parsers(renderer.tokenizer, "hermes", reasoning, "task")
    script = Script(renderer, texts)
    url, opened = gateway.open(
        renderer,
        parsers,
        seed=7,
        order=0,
        sample=_defaults(script.sample, None, 64),
        max_turns=max_turns,
    )
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=gateway.app))
    client = openai.AsyncOpenAI(base_url=url, api_key=opened.key, http_client=http, max_retries=0)
    return client, opened, script, gateway


def run(coroutine):
    return asyncio.run(coroutine)


def test_a_tool_call_turn_and_its_answer_are_one_segment_of_the_sampled_ids(renderer):
    client, opened, script, _ = serve(renderer, [CALL, "7"])

    async def episode():
        first = await client.chat.completions.create(
            model="policy",
            messages=USER,
            tools=Calculator.schemas,
            logprobs=True,
            extra_body={"return_token_ids": True},
        )
        message = first.choices[0].message
        replies = [{"role": "tool", "content": "7", "tool_call_id": message.tool_calls[0].id}]
        second = await client.chat.completions.create(
            model="policy",
            messages=[*USER, message.model_dump(exclude_none=True), *replies],
            tools=Calculator.schemas,
            extra_body={"return_token_ids": True},
        )
        return first, second

    first, second = run(episode())
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "calc"
    assert json.loads(call.function.arguments) == {"expression": "max(3,7)"}
    sampled = encode(renderer, CALL) + [IM_END]
    assert first.choices[0].token_ids == sampled  # vLLM's field names, parsed by the SDK
    assert first.usage.prompt_tokens == len(first.prompt_token_ids)
    assert first.usage.completion_tokens == len(sampled)
    assert [c.logprob for c in choice.logprobs.content] == [-0.5] * len(sampled)
    # Turn 2's prompt: turn 1's prompt and sampled ids, then the tool reply alone rendered.
    assert second.prompt_token_ids[: len(first.prompt_token_ids) + len(sampled)] == (
        first.prompt_token_ids + sampled
    )
    assert second.choices[0].finish_reason == "stop"
    assert second.choices[0].message.content == "7"
    (segment,) = opened.session.segments
    delta = second.prompt_token_ids[len(first.prompt_token_ids) + len(sampled) :]
    answer = encode(renderer, "7") + [IM_END]
    assert segment.first_ids == first.prompt_token_ids
    assert segment.token_ids == sampled + delta + answer
    assert segment.sampled_mask == [1] * len(sampled) + [0] * len(delta) + [1] * len(answer)
    assert segment.versions == [3] * len(sampled) + [-1] * len(delta) + [3] * len(answer)
    # The delta is what the environment path renders for the same reply.
    assert delta == renderer.reply_ids(
        USER, [{"role": "tool", "content": "7"}], Calculator.schemas, stop_id=IM_END
    )
    assert opened.tool_calls == 1 and opened.ill_formed_tool_calls == 0
    # Sampled with the session's seeds, as an environment's turns are.
    assert [options["seed"] for _, options in script.requests] == [7, (7 * 1_000_003 + 1) % 2**62]


def test_what_clients_change_in_sent_back_turns_keeps_the_segment_and_an_edit_forks(renderer):
    thought = "<think>3 or 7</think>" + CALL
    client, opened, _, _ = serve(renderer, [thought, "7", "8", "9"], reasoning="qwen3")

    async def ask(messages):
        return await client.chat.completions.create(
            model="policy", messages=messages, tools=Calculator.schemas
        )

    async def episode():
        first = (await ask(USER)).choices[0].message
        assert first.model_extra["reasoning_content"] == "3 or 7"
        sent = first.model_dump(exclude_none=True)
        # The client drops the reasoning and serialises the arguments its own way.
        sent.pop("reasoning_content")
        sent["tool_calls"][0]["function"]["arguments"] = '{ "expression" : "max(3,7)" }'
        tool = {"role": "tool", "content": "7"}
        await ask([*USER, sent, tool])
        assert len(opened.session.segments) == 1
        # Turn 1 again with another reply: a fork from turn 1's ids.
        await ask([*USER, sent, {"role": "tool", "content": "8"}])
        assert len(opened.session.segments) == 2
        # An edited history: a new segment from its whole rendered chat.
        edited = {"role": "assistant", "content": "I know: 7"}
        await ask([*USER, edited, tool])

    run(episode())
    first, fork, edited = opened.session.segments
    assert opened.session.forks == 2
    call = encode(renderer, thought) + [IM_END]
    assert first.token_ids[: len(call)] == call == fork.token_ids[: len(call)]
    assert first.sampled_mask[: len(call)] == [1] * len(call)
    assert edited.sampled_mask == [1] * len(edited.token_ids)  # its history is prompt, not trained
    assert edited.first_ids == encode(
        renderer,
        renderer.chat([*USER, {**edited.sent[1]}, edited.sent[2]], Calculator.schemas, True),
    )


def test_streaming_gives_the_non_streamed_answer_and_usage(renderer):
    texts = ["x=3", CALL]

    async def both(stream: bool, tools):
        client, _, _, _ = serve(renderer, texts)
        out = []
        for _ in texts:
            kwargs = {"model": "policy", "messages": USER, "tools": tools}
            if not stream:
                response = await client.chat.completions.create(**kwargs)
                out.append(response.choices[0].model_dump(exclude={"logprobs", "index"}))
                continue
            chunks = [
                c
                async for c in await client.chat.completions.create(
                    **kwargs, stream=True, stream_options={"include_usage": True}
                )
            ]
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
            assert chunks[-1].usage.completion_tokens == len(encode(renderer, texts[0])) + 1
            out.append(
                {
                    "finish_reason": finish,
                    "message": {
                        "content": content or None,
                        "role": "assistant",
                        "tool_calls": [
                            {"id": t.id, "function": t.function.model_dump(), "type": "function"}
                            for t in calls
                        ]
                        or None,
                    },
                }
            )
            texts.insert(0, texts.pop())  # the same script again
        return out

    for tools in (None, Calculator.schemas):
        texts[:] = ["x=3", CALL] if tools is None else [CALL, "x=3"]
        plain = run(both(False, tools))
        texts[:] = ["x=3", CALL] if tools is None else [CALL, "x=3"]
        streamed = run(both(True, tools))
        for a, b in zip(plain, streamed, strict=True):
            a["message"] = {k: v for k, v in a["message"].items() if v is not None}
            b["message"] = {k: v for k, v in b["message"].items() if v is not None}
            for call in a["message"].get("tool_calls", []) + b["message"].get("tool_calls", []):
                call["id"] = "same"  # vLLM names each call anew
            assert (a["finish_reason"], a["message"]) == (b["finish_reason"], b["message"])


def test_errors_answer_in_openai_format_naming_the_field(renderer):
    client, opened, _, gateway = serve(renderer, ["1", "2", "3"], max_turns=1, max_model_len=40)

    async def errors():
        caught = {}
        cases = {
            "n": {"n": 2},
            "top_logprobs": {"logprobs": True, "top_logprobs": 2},
            "temperature": {"temperature": -1},
            "tool_choice": {"tool_choice": {"type": "function", "function": {"name": "calc"}}},
        }
        for name, extra in cases.items():
            try:
                await client.chat.completions.create(model="policy", messages=USER, **extra)
            except openai.BadRequestError as e:
                caught[name] = e.body["param"]
        parts = {
            "image": {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            "http": {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
            "audio": {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}},
        }
        for name, part in parts.items():
            try:
                await client.chat.completions.create(
                    model="policy", messages=[{"role": "user", "content": [part]}]
                )
            except openai.BadRequestError as e:
                caught[name] = (e.body["param"], e.message)
        long = [{"role": "user", "content": "9" * 60}]
        try:
            await client.chat.completions.create(model="policy", messages=long)
        except openai.BadRequestError as e:
            caught["long"] = e.message
        await client.chat.completions.create(model="policy", messages=USER)
        try:
            await client.chat.completions.create(model="policy", messages=USER)
        except openai.BadRequestError as e:
            caught["turns"] = e.message
        wrong = client.with_options(api_key="not-the-key")
        try:
            await wrong.models.list()
        except openai.AuthenticationError:
            caught["key"] = True
        models = await client.models.list()
        gateway.close(opened)
        try:
            await client.models.list()
        except openai.NotFoundError:
            caught["ended"] = True
        return caught, models

    caught, models = run(errors())
    assert [m.id for m in models.data] == ["policy"]
    assert {k: caught[k] for k in ("n", "top_logprobs", "temperature", "tool_choice")} == {
        "n": "n",
        "top_logprobs": "top_logprobs",
        "temperature": "temperature",
        "tool_choice": "tool_choice",
    }
    # The text-only policy reads no image; no URL is fetched; no other part is taken.
    assert caught["image"][0] == "messages[0].content[0]"
    assert "messages[0].content[0]: the policy reads no images" in caught["image"][1]
    assert caught["http"][0] == "messages[0].content"
    assert "part 0's image_url.url is not a data URL ('https://example.com" in caught["http"][1]
    assert "input_audio parts are not supported by the gateway" in caught["audio"][1]
    assert "generator.max_model_len = 40" in caught["long"]
    assert "task.max_turns" in caught["turns"]
    assert caught["key"] and caught["ended"]


def test_an_unparsable_call_is_content_and_counted(renderer):
    client, opened, _, _ = serve(renderer, ['<tool_call>{"name": calc}</tool_call>'])

    async def ask():
        return await client.chat.completions.create(
            model="policy", messages=USER, tools=Calculator.schemas
        )

    choice = run(ask()).choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert choice.message.content.startswith("<tool_call>")
    assert opened.ill_formed_tool_calls == 1 and opened.tool_calls == 1


def test_a_group_trains_on_the_prompt_its_agents_share():
    group = [Episode(first_ids=[1, 2, 3, 4]), Episode(first_ids=[1, 2, 5])]
    for episode in group:
        episode.add([9, 9], [-0.1, -0.2])
    assert _shared_prompt(group) == [1, 2]
    assert group[0].token_ids == [3, 4, 9, 9] and group[0].sampled_mask == [0, 0, 1, 1]
    assert group[1].token_ids == [5, 9, 9] and group[1].logprobs == [0.0, -0.1, -0.2]
    with pytest.raises(ConfigError, match="share no token"):
        _shared_prompt([Episode(first_ids=[1]), Episode(first_ids=[2])])


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"name": "agent"}, "needs one of task.agent"),
        ({"name": "agent", "agent": "a:b", "agent_url": "http://x"}, "needs one of task.agent"),
        ({"name": "dataset", "agent": "a:b"}, "task.agent = 'a:b' but task.name = 'dataset'"),
        ({"name": "agent", "agent": "nocolon"}, "write it as 'module:function'"),
        ({"name": "agent", "agent_url": "ftp://x"}, "must be an http:// or https:// URL"),
    ],
)
def test_agent_fields_are_checked_in_one_line(flags, message, tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    with pytest.raises(ConfigError, match=message):
        TaskSection(dataset_path=str(data), **flags).validate()


def test_an_unknown_parser_or_an_agent_that_is_not_async_is_one_line(renderer):
    with pytest.raises(ConfigError, match="task.tool_parser = 'hermez' is not one of vLLM's"):
        load_parsers(renderer.tokenizer, "hermez", None, "task")
    from torchtitan_rl.tasks.agent import load_agent

    with pytest.raises(ConfigError, match="is not a coroutine function"):
        load_agent("torchtitan_rl.tasks.env:calc", None)


def test_agents_rewards_failures_and_idle_timeouts_score_as_environments_do(renderer):
    """`Episodes` running agents on a scripted policy: a returned reward, None (the task's
    reward function scores the final answer), a reward reported on /rl/reward, an agent that
    raises and one that goes idle past task.env_timeout_s (reward_on_error = "zero")."""
    from torchtitan_rl.episodes import Episodes, Source
    from torchtitan_rl.tasks.agent import Endpoint
    from torchtitan_rl.tasks.dataset import DatasetTask
    from torchtitan_rl.tasks.env import SingleTurn
    from torchtitan_rl.tasks.rewards import Scorer
    from torchtitan_rl.types import Prompt

    async def agent(endpoint: Endpoint, row: dict):
        if row["answer"] == "6":
            raise RuntimeError("the agent broke before asking")
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=gateway.app))
        client = openai.AsyncOpenAI(
            base_url=endpoint.base_url, api_key=endpoint.api_key, http_client=http
        )
        answer = await client.chat.completions.create(model=endpoint.model, messages=USER)
        kind = row["answer"]
        if kind == "2":
            return 0.25
        if kind == "3":
            await http.post(
                endpoint.base_url.removesuffix("/v1") + "/rl/reward",
                json={"reward": 0.5},
                headers={"Authorization": f"Bearer {endpoint.api_key}"},
            )
        if kind == "4":
            raise RuntimeError("the agent's tool broke")
        if kind == "5":
            await asyncio.sleep(60)
        return None if answer else 0.0

    gateway = Gateway(stop_ids={IM_END}, max_model_len=512)
    parsers = load_parsers(renderer.tokenizer, "hermes", None, "task")
    source = Source(renderer, SingleTurn, 4, agent, parsers)
    scorer = Scorer(DatasetTask.__new__(DatasetTask), {}, "zero")
    episodes = Episodes(
        {"": source}, scorer, stop_ids=[IM_END], max_model_len=512, timeout_s=0.3, gateway=gateway
    )
    script = Script(renderer, ["7"] * 5)
    prompts = [Prompt("max(3,7)=", answer) for answer in ("7", "2", "3", "4", "5", "6")]
    scored = run(
        episodes._agents(script.sample, lambda p: asyncio.gather(*p), prompts, 0, 1, None, 8)
    )
    assert scored.rewards_PN.flatten().tolist() == [1.0, 0.25, 0.5, 0.0, 0.0, 0.0]
    assert scorer.errors == 3
    assert [g[0].turns for g in scored.completions.samples] == [1] * 5 + [0]
    # The agent that never asked: its opening prompt and a stop id, nothing to train.
    never = scored.completions.samples[5][0]
    assert never.token_ids == [IM_END] and never.sampled_mask == [0]
    assert not gateway.sessions  # every session ended with its episode


def test_concurrent_branches_of_a_session_fork_and_client_stops_leave_the_answer(renderer):
    client, opened, script, _ = serve(renderer, ["x=3", "y=4", "z=5"])

    async def branches():
        first = (await client.chat.completions.create(model="policy", messages=USER)).choices[0]
        history = [*USER, first.message.model_dump(exclude_none=True)]
        asks = [
            client.chat.completions.create(
                model="policy",
                messages=[*history, {"role": "tool", "content": reply}],
                stop=["="],
            )
            for reply in ("a", "b")
        ]
        return first, await asyncio.gather(*asks)

    first, (a, b) = run(branches())
    assert first.message.content == "x=3"
    assert (a.choices[0].message.content, b.choices[0].message.content) == ("y", "z")
    one, two = opened.session.segments
    turn = encode(renderer, "x=3") + [IM_END]
    assert one.token_ids[: len(turn)] == turn == two.token_ids[: len(turn)]
    # Each branch recorded on its own context: the ids its prompt had, then its own sample.
    prompts = [ids for ids, _ in script.requests[1:]]
    assert one.first_ids + one.token_ids[: len(prompts[0]) - len(one.first_ids)] == prompts[0]
    assert two.first_ids + two.token_ids[: len(prompts[1]) - len(two.first_ids)] == prompts[1]
    assert one.token_ids[len(prompts[0]) - len(one.first_ids) :] == encode(renderer, "y=4") + [
        IM_END
    ]
    seeds = [options["seed"] for _, options in script.requests]
    assert len(set(seeds)) == 3  # each request its own seed


def test_the_gateway_serves_where_its_config_says_with_the_parsers_it_names(tmp_path):
    import socket

    from torchtitan_rl.config import JobConfig
    from torchtitan_rl.episodes import open_task

    free = socket.socket()
    free.bind(("127.0.0.2", 0))
    port = free.getsockname()[1]
    free.close()
    config = JobConfig()
    config.model.hf_checkpoint = "assets/tiny_qwen3"
    config.model.resolve()
    task = config.task
    task.name, task.agent = "agent", "user_envs:chatter_agent"
    task.dataset_path, task.gateway_host, task.gateway_port = (
        "data/arith/train.jsonl",
        "127.0.0.2",
        port,
    )
    opened = open_task(config)
    gateway = opened.episodes.gateway
    assert opened.sources[""].parsers.tool is not None  # hermes, task.tool_parser's default
    assert opened.sources[""].parsers.reasoning is None

    async def serve():
        await gateway.start()
        url, _ = gateway.open(None, None, seed=0, order=0, sample=None, max_turns=1)
        _, writer = await asyncio.open_connection("127.0.0.2", port)  # it listens there
        writer.close()
        return url

    assert run(serve()).startswith(f"http://127.0.0.2:{port}/s/")
    # task.tool_parser / task.reasoning_parser choose vLLM's parsers (none: calls stay text).
    task.tool_parser, task.reasoning_parser = "none", "qwen3"
    parsers = open_task(config).sources[""].parsers
    assert parsers.tool is None and parsers.reasoning is not None
    task.gateway_port = 70000
    with pytest.raises(ConfigError, match="task.gateway_port = 70000: must be a TCP port"):
        task.validate()


def test_image_url_parts_reach_the_policy_token_exact_turn_after_turn():
    """A vision-language policy's session: the row's image, handed to the agent as a data URL
    (`row_of`), prompts the ids and images the dataset path renders for the row; a user reply
    with another image extends the segment with that image's run after the sampled ids, and
    the request carries both images where their runs are. The episode's sample carries them
    to the trainer's rows. A message sent back with another image is not the recorded one
    (the request forks); an image that does not decode is a 400 naming its part."""
    renderer = vision_renderer()
    rng = np.random.default_rng(0)
    first, second, other = (
        PIL.Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))
        for size in ((56, 84), (56, 56), (56, 84))
    )
    row = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "a"}, {"type": "image", "image": first}],
        }
    ]
    prompt = Prompt(text="a", answer="", messages=tuple(row), images=(first,))
    (row_ids,), (row_images,) = renderer.encode_images([prompt])
    messages = row_of(prompt, row)["messages"]
    assert messages[0]["content"][1]["image_url"]["url"].startswith("data:image/png;base64,")
    reply = {"type": "image_url", "image_url": {"url": data_url(second)}}
    client, opened, script, _ = serve(renderer, ["b", "c", "d"])

    async def episode():
        answer = await client.chat.completions.create(model="policy", messages=messages)
        said = answer.choices[0].message.model_dump(exclude_none=True)
        user = {"role": "user", "content": [{"type": "text", "text": "e"}, reply]}
        await client.chat.completions.create(model="policy", messages=[*messages, said, user])
        changed = [{**messages[0], "content": [messages[0]["content"][0], _url(other)]}]
        await client.chat.completions.create(model="policy", messages=[*changed, said, user])
        not_png = "data:image/png;base64," + base64.b64encode(b"not a png").decode()
        bad = [{"role": "user", "content": [{"type": "text", "text": "a"}, _url(not_png)]}]
        try:
            await client.chat.completions.create(model="policy", messages=bad)
        except openai.BadRequestError as e:
            return e.body["param"], e.message

    param, message = run(episode())
    (ids_1, options_1), (ids_2, options_2), (ids_3, options_3) = script.requests
    assert ids_1 == row_ids and same_images(options_1["images"], row_images)
    sampled = encode(renderer, "b") + [IM_END]
    images = options_2["images"]
    assert ids_2[: len(ids_1) + len(sampled)] == ids_1 + sampled
    assert images.starts[0] == row_images.starts[0] and len(images.starts) == 2
    assert images.starts[1] > len(ids_1) + len(sampled)
    located = renderer.images.images(ids_2, images.pixel_values_PX, images.grid_thw_N3)
    assert same_images(images, located)  # each image's run where its start says
    assert torch.equal(
        images.pixel_values_PX[: len(row_images.pixel_values_PX)], row_images.pixel_values_PX
    )
    assert torch.equal(images.grid_thw_N3, torch.tensor([[1, 4, 6], [1, 4, 4]]))
    # The changed image starts a new segment: the same ids, the policy shown the new image.
    assert opened.session.forks == 1 and ids_3[: len(ids_1)] == ids_1
    shown = options_3["images"].pixel_values_PX[: len(row_images.pixel_values_PX)]
    assert torch.equal(shown, renderer.images.read([other])[0])
    assert param == "messages[0].content[1]"
    assert "image data URL is not an image PIL can decode" in message
    # The episode trains on the last segment, with its images.
    episode = Episode()
    _take(episode, opened)
    sample = episode.sample("stop", len(episode.first_ids))
    assert sample.images is opened.session.final().images
    batch = rollout_batch([episode.first_ids], [[sample]], torch.zeros(1, 1), 0)
    assert batch.images_B == (sample.images,)


def _url(image) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(image)}}


def test_a_large_image_is_read_off_the_event_loop_while_other_sessions_answer():
    """Decoding and resizing a request's image runs in a thread: while one session's large
    image (2,400 x 1,800, LANCZOS-resized) is being read, another session's turn is answered.
    The read is held until that answer arrives (or 20 s): read on the event loop, it would
    hold the other answer back the whole time."""
    import threading
    import time

    renderer = vision_renderer()
    gateway = Gateway(stop_ids={IM_END}, max_model_len=4096)
    parsers = load_parsers(renderer.tokenizer, "hermes", None, "task")
    clients = []
    for order in range(2):
        script = Script(renderer, ["b"])
        url, opened = gateway.open(
            renderer,
            parsers,
            seed=7,
            order=order,
            sample=_defaults(script.sample, None, 8),
            max_turns=8,
        )
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=gateway.app))
        clients.append(
            openai.AsyncOpenAI(base_url=url, api_key=opened.key, http_client=http, max_retries=0)
        )
    answered, reading = threading.Event(), threading.Event()
    read = renderer.images.read

    read_at = []

    def held_read(images):
        read_at.append(time.monotonic())
        reading.set()
        answered.wait(timeout=20)
        return read(images)

    large = PIL.Image.fromarray(
        np.random.default_rng(0).integers(0, 256, (1800, 2400, 3), dtype=np.uint8)
    )
    looks = [{"type": "text", "text": "a"}, _url(large)]

    async def both():
        async def text_turn():
            while not reading.is_set():
                await asyncio.sleep(0.01)
            await clients[1].chat.completions.create(model="policy", messages=USER)
            answered.set()
            return time.monotonic() - read_at[0]

        image_turn = clients[0].chat.completions.create(
            model="policy", messages=[{"role": "user", "content": looks}]
        )
        return await asyncio.gather(image_turn, text_turn())

    renderer.images.read = held_read
    try:
        image_answer, waited = run(both())
    finally:
        renderer.images.read = read
    assert waited < 10, f"the text turn was answered {waited:.1f} s into the other's read"
    assert image_answer.choices[0].message.content == "b"
