"""A session's record of what the policy sampled, token-exact, whatever chat messages the
client sends back.

    .venv/bin/python -m pytest tests/unit/test_gateway.py

A session is one episode of an agent. Its turns are kept as segments: a segment is one
training sequence, its first prompt then every id after it (`Trace`: sampled ids, masked in,
and the ids rendered between turns, masked out). A request whose messages extend a segment's
last turn (the messages the segment holds, then only new non-assistant ones: tool results, a
user's reply) gets the segment's ids plus those new messages rendered on their own
(`Renderer.reply_ids`): the history is never rendered again, so the ids the model sampled stay
the ids it is trained on. A request that extends an earlier turn of a segment forks a new
segment from that turn's ids; one that extends nothing starts a new segment from its whole
rendered chat. Matching tolerates what clients change in the assistant messages they send
back: a stripped or moved `<think>` block, reasoning sent as `reasoning_content`, tool-call
arguments serialised again, content None beside tool calls.

A message's `image_url` parts (data URLs: the gateway fetches nothing) reach a vision-language
policy as the dataset's image parts do: the chat template writes one `<|patch|>` per part,
expanded to the image's run (vision/prompts.py). A segment keeps its images placed in its ids,
and each request carries those of its prompt to the engine; a message is the one recorded only
with the same images.
"""

import json
import re
from dataclasses import dataclass, field

import torch

from torchtitan_rl.config import ConfigError
from torchtitan_rl.tasks.render import Renderer
from torchtitan_rl.types import Images, Sample, Trace
from torchtitan_rl.vision.prompts import images_before, join_images

_THINK = re.compile(r"<think>.*?(</think>|$)", re.DOTALL)


@dataclass(slots=True)
class Segment(Trace):
    """One training sequence of a session: `first_ids`, then the trace."""

    first_ids: list[int] = field(default_factory=list)
    rendered: list[dict] = field(default_factory=list)
    """The messages as the chat template renders them (an assistant turn as the model wrote
    it, tool-call markup and all)."""
    sent: list[dict] = field(default_factory=list)
    """The messages as the client holds them (an assistant turn as the gateway answered it)."""
    tools: list[dict] | None = None
    turn_ends: list[tuple[int, int]] = field(default_factory=list)
    """After each turn: (messages, ids of the trace) it had."""
    finish_reason: str = "stop"
    """The last turn's (the episode's, when this segment is the one trained on)."""
    waits_for_tool: bool = False
    """The last turn called tools (parsed or not) that no request answered yet."""
    images: Images | None = None
    """The images of its messages, placed in `first_ids` + the trace's ids."""

    @property
    def length(self) -> int:
        return len(self.first_ids) + len(self.token_ids)

    def extended_by(self, messages: list[dict], tools: list[dict] | None) -> int | None:
        """The turn (index) whose messages `messages` extend with new non-assistant ones,
        else None."""
        if not _same_tools(tools, self.tools):
            return None
        for turn in range(len(self.turn_ends) - 1, -1, -1):
            count = self.turn_ends[turn][0]
            if len(messages) <= count or any(
                m.get("role") == "assistant" for m in messages[count:]
            ):
                continue
            if all(_same(a, b) for a, b in zip(self.sent[:count], messages, strict=False)):
                return turn
        return None

    def fork(self, turn: int) -> "Segment":
        """A new segment holding this one's ids and messages up to the end of `turn`."""
        count, ids = self.turn_ends[turn]
        return Segment(
            token_ids=self.token_ids[:ids],
            logprobs=self.logprobs[:ids],
            sampled_mask=self.sampled_mask[:ids],
            versions=None if self.versions is None else self.versions[:ids],
            routed=None
            if self.routed is None
            else self.routed[: len(self.first_ids) + ids].clone(),
            first_ids=self.first_ids,
            rendered=self.rendered[:count],
            sent=self.sent[:count],
            tools=self.tools,
            turn_ends=self.turn_ends[: turn + 1],
            images=images_before(self.images, len(self.first_ids) + ids),
        )


@dataclass(frozen=True, slots=True)
class Turn:
    """A request's place in its session, before it is sampled."""

    segment: Segment
    prompt_ids: list[int]
    delta: list[int]
    """The ids of the request's new messages, after the segment's ids (mask 0)."""
    messages: list[dict]
    new: bool
    """The segment is new (a first request, a fork, a new history): recorded as a segment."""
    extends: int = -1
    """The turn of `segment` the request extends (-1: none)."""
    length: int = 0
    """`segment`'s ids when the request was made: another request of the session that
    recorded meanwhile (concurrent branches) makes this one a fork."""
    images: Images | None = None
    """The images of `prompt_ids` (the segment's, then the new messages')."""


class Session:
    """The segments of one episode, and the prompt of each request."""

    def __init__(self, renderer: Renderer, stop_ids: set[int]):
        self.renderer, self.stop_ids = renderer, stop_ids
        self.segments: list[Segment] = []
        self.turns = 0
        """Turns recorded."""
        self.asked = 0
        """Requests made: the next one's turn number (its seed, as `Episodes` seeds an
        environment's turns)."""
        self.forks = 0
        """Segments after the first: requests that extended an earlier turn (a fork), or no
        recorded turn (a history the client changed)."""
        self.pixels: dict[str, tuple] = {}
        """Each image URL of the session read (`read_images`): (pixel_values_PX, grid_thw_13)."""

    def read_images(self, messages: list[dict]) -> None:
        """Decode and resize the images of `messages`' image_url parts not read yet (the
        gateway runs this in a thread, off its event loop: a large image would stall every
        session's requests and the run's stream). One that does not read is left for the
        request to name (`_read`)."""
        if self.renderer.images is None:
            return
        for message in messages:
            try:
                urls = [url for _, url in _image_urls(message.get("content"))]
            except ValueError:
                continue  # not a data URL: the request's check names it
            for url in urls:
                if url not in self.pixels:
                    try:
                        self.pixels[url] = self.renderer.images.read([url])
                    except ValueError:
                        continue

    def prompt(self, messages: list[dict], tools: list[dict] | None) -> "Turn":
        """The turn a request of `messages` (and `tools`) asks for: the segment it continues
        (new, forked, or the last), and its prompt ids: that segment's ids, then the new
        messages rendered. Nothing is recorded until the turn is (`record`)."""
        for segment in reversed(self.segments):
            turn = segment.extended_by(messages, tools)
            if turn is None:
                continue
            last = turn == len(segment.turn_ends) - 1 and segment is self.segments[-1]
            base = segment if last else segment.fork(turn)
            found = self._delta(base, messages)
            if found is None:
                break
            delta, images = found
            prompt_ids = base.first_ids + base.token_ids + delta
            images = join_images(base.images, images, base.length)
            length = len(base.token_ids)
            return Turn(base, prompt_ids, delta, messages, not last, turn, length, images)
        pixels = self._read(messages, 0)
        text = self.renderer.chat(_for_template(messages), tools, generation_prompt=True)
        first_ids, images = self.renderer.encode_chat(text, pixels)
        segment = Segment(first_ids=first_ids, tools=tools, images=images)
        return Turn(segment, list(first_ids), [], messages, True, images=images)

    def _delta(
        self, segment: Segment, messages: list[dict]
    ) -> tuple[list[int], Images | None] | None:
        """The ids of `messages`' new ones after `segment`'s last turn, and their images
        placed in them; None when the chat template cannot render them on their own (then the
        request starts a new segment)."""
        last = segment.token_ids[-1] if segment.token_ids else None
        replies = messages[len(segment.sent) :]
        pixels = self._read(replies, len(segment.sent))
        try:
            text = self.renderer.reply_text(
                segment.rendered[:-1],
                _for_template(replies),
                segment.tools,
                stop_id=last if last in self.stop_ids else None,
            )
        except ConfigError:  # a template that renders earlier turns anew (reply_text)
            return None
        return self.renderer.encode_chat(text, pixels)

    def _read(self, messages: list[dict], first: int) -> tuple | None:
        """(pixel_values_PX, grid_thw_N3) of the `image_url` parts of `messages` (the
        request's from message `first` on), None without any. An image the policy cannot
        read, or any image for a text-only policy: BadPart naming its part."""
        rows, grids = [], []
        for i, message in enumerate(messages, first):
            for j, url in _image_urls(message.get("content")):
                where = f"messages[{i}].content[{j}]"
                if self.renderer.images is None:
                    raise BadPart(where, "the policy reads no images (a text-only model)")
                if url not in self.pixels:
                    try:
                        self.pixels[url] = self.renderer.images.read([url])
                    except ValueError as e:
                        raise BadPart(where, str(e).removeprefix("image 0: ")) from None
                pixel_values_PX, grid_thw_13 = self.pixels[url]
                rows.append(pixel_values_PX)
                grids.append(grid_thw_13)
        return (torch.cat(rows), torch.cat(grids)) if rows else None

    def record(
        self, turn: "Turn", sample: Sample, text: str, message: dict, ill_formed: int = 0
    ) -> None:
        """Record a sampled turn: the new messages' ids, then the ids `sample` gives (`text`:
        decoded, as the chat template renders it again), and `message` as the client was
        answered (`ill_formed`: its calls that did not parse, returned as text)."""
        segment = turn.segment
        if not turn.new and len(segment.token_ids) != turn.length:
            segment = segment.fork(turn.extends)  # a concurrent request of the session recorded
        if turn.new or segment is not turn.segment:
            self.forks += bool(self.segments)
            self.segments.append(segment)
        self.turns += 1
        segment.add(turn.delta)
        segment.rendered += _for_template(turn.messages[len(segment.sent) :])
        segment.sent = list(turn.messages)
        segment.route(sample.routed_experts)
        segment.add(sample.token_ids, sample.logprobs, sample.versions)
        segment.rendered.append({"role": "assistant", "content": text})
        segment.sent.append(message)
        segment.turn_ends.append((len(segment.sent), len(segment.token_ids)))
        segment.finish_reason = sample.finish_reason
        segment.waits_for_tool = bool(message.get("tool_calls")) or ill_formed > 0
        segment.images = turn.images

    def final(self) -> Segment | None:
        """The segment the episode trains on: the last one a request continued."""
        return self.segments[-1] if self.segments else None


class BadPart(ValueError):
    """A message part the gateway cannot take: its field (`param`) and why."""

    def __init__(self, param: str, reason: str):
        super().__init__(f"{param}: {reason}")
        self.param = param


def text_of(content) -> str:
    """A message's content as text: a string, None, or OpenAI's list of parts (its images
    aside: `_image_urls`). Parts other than text and image_url: one ValueError line."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        kinds = {part.get("type") for part in content if isinstance(part, dict)}
        if kinds - {"text", "image_url"}:
            raise ValueError(
                f"{sorted(map(str, kinds - {'text', 'image_url'}))[0]} parts are not supported "
                "by the gateway: send text and image_url parts"
            )
        _image_urls(content)
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    raise ValueError(f"content must be a string or a list of parts, not {type(content).__name__}")


def _image_urls(content) -> list[tuple[int, str]]:
    """(part index, data URL) of each image_url part of a message's content; a URL that is no
    data URL: one ValueError line (the gateway fetches nothing)."""
    if not isinstance(content, list):
        return []
    urls = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "image_url":
            continue
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        if not isinstance(url, str) or not url.startswith("data:"):
            raise ValueError(
                f"part {j}'s image_url.url is not a data URL ({str(url)[:40]!r}): the gateway "
                "fetches nothing; send the image as data:image/png;base64,..."
            )
        urls.append((j, url))
    return urls


def _for_template(messages: list[dict]) -> list[dict]:
    """Messages as chat templates take them: content as text, or as its text and image_url
    parts where it holds images (the template writes one `<|patch|>` for each)."""
    return [{**m, "content": _template_content(m.get("content"))} for m in messages]


def _template_content(content):
    if not _image_urls(content):
        return text_of(content)
    return [part for part in content if part.get("type") in ("text", "image_url")]


def _same(recorded: dict, sent: dict) -> bool:
    """Whether a client's message is the recorded one, as clients send messages back."""
    if recorded.get("role") != sent.get("role"):
        return False
    if recorded["role"] != "assistant":
        recorded, sent = recorded.get("content"), sent.get("content")
        return text_of(recorded) == text_of(sent) and _image_urls(recorded) == _image_urls(sent)
    if _visible(recorded.get("content")) != _visible(sent.get("content")):
        return False
    return _calls(recorded) == _calls(sent)


def _visible(content) -> str:
    """An assistant message's text without its reasoning."""
    return _THINK.sub("", text_of(content)).strip()


def _calls(message: dict) -> list:
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function", {}) if isinstance(call, dict) else {}
        arguments = function.get("arguments")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except json.JSONDecodeError:
            pass
        calls.append((function.get("name"), arguments))
    return calls


def _same_tools(a: list[dict] | None, b: list[dict] | None) -> bool:
    return (a or None) == (b or None)
