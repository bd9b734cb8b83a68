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
"""

import json
import re
from dataclasses import dataclass, field

from torchtitan_rl.config import ConfigError
from torchtitan_rl.tasks.render import Renderer
from torchtitan_rl.types import Sample, Trace

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
            delta = self._delta(base, messages)
            if delta is None:
                break
            prompt_ids = base.first_ids + base.token_ids + delta
            return Turn(base, prompt_ids, delta, messages, not last, turn, len(base.token_ids))
        text = self.renderer.chat(_for_template(messages), tools, generation_prompt=True)
        first_ids = self.renderer.tokenizer.encode(text, add_special_tokens=False)
        segment = Segment(first_ids=first_ids, tools=tools)
        return Turn(segment, list(first_ids), [], messages, True)

    def _delta(self, segment: Segment, messages: list[dict]) -> list[int] | None:
        """The ids of `messages`' new ones after `segment`'s last turn; None when the chat
        template cannot render them on their own (then the request starts a new segment)."""
        last = segment.token_ids[-1] if segment.token_ids else None
        try:
            return self.renderer.reply_ids(
                segment.rendered[:-1],
                _for_template(messages[len(segment.sent) :]),
                segment.tools,
                stop_id=last if last in self.stop_ids else None,
            )
        except ConfigError:  # a template that renders earlier turns anew (reply_ids)
            return None

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

    def final(self) -> Segment | None:
        """The segment the episode trains on: the last one a request continued."""
        return self.segments[-1] if self.segments else None


def text_of(content) -> str:
    """A message's content as text: a string, None, or OpenAI's list of parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        kinds = {part.get("type") for part in content if isinstance(part, dict)}
        if kinds - {"text"}:
            raise ValueError(
                f"{sorted(map(str, kinds - {'text'}))[0]} parts are not supported by the "
                "gateway yet (images reach the policy in dataset rows: docs/vision.md): send text"
            )
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    raise ValueError(f"content must be a string or a list of parts, not {type(content).__name__}")


def _for_template(messages: list[dict]) -> list[dict]:
    """Messages as chat templates take them: content as text."""
    return [{**m, "content": text_of(m.get("content"))} for m in messages]


def _same(recorded: dict, sent: dict) -> bool:
    """Whether a client's message is the recorded one, as clients send messages back."""
    if recorded.get("role") != sent.get("role"):
        return False
    if recorded["role"] != "assistant":
        return text_of(recorded.get("content")) == text_of(sent.get("content"))
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
