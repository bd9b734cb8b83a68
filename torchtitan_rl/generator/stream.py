"""The engine as a request API: submit one sample's request, step the engine, take each sample as
it finishes, each token tagged with the policy version that sampled it. New weights load
between engine steps, without draining the requests in flight (continuous placement).

    .venv/bin/python -m pytest tests/integration/test_continuous.py

After a weight update, the KV of the requests in flight follows `generator.inflight_kv`:
"recompute" preempts them (vLLM's `reset_prefix_cache(reset_running_requests=True)`): their
prompt and the tokens sampled so far are prefilled again with the new weights, so a token
sampled under version v has exactly the logprob version v gives it over its whole prefix.
"keep" goes on with the KV computed by the older weights (no recompute; the tokens after the
update are sampled from a mixture of the two versions). Either way the prefix cache serves no
request KV that other weights computed: every request carries its policy version as vLLM's
cache salt, which the cached blocks' hashes include.

Engine steps are synchronous here; `AsyncStream` puts them on an event loop, so that episodes
(tasks.episodes) await their turns as coroutines and an environment's reply never waits for
another episode's.
"""

import asyncio
import itertools
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from torchtitan_rl.generator.base import Generator
from torchtitan_rl.types import Sample


@dataclass(slots=True)
class Live:
    """A request in flight: what it has sampled so far."""

    key: Hashable
    listener: Callable[[list[int]], None] | None = None
    """Called with each step's new tokens (a streaming client's response)."""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    """The policy version that sampled each token."""


_numbers = itertools.count()
"""Request numbers, unique in the process: a stream's requests never share an id with another
stream's still in the engine."""


class RequestStream:
    """Requests of one sample each (n = 1) on `engine`, stepped one engine step at a time."""

    def __init__(self, engine: Generator):
        self.engine = engine
        self.live: dict[str, Live] = {}

    def submit(
        self,
        key: Hashable,
        prompt_token_ids: Sequence[int],
        *,
        seed: int,
        max_tokens: int,
        temperature: float | None = None,
        listener: Callable[[list[int]], None] | None = None,
        **sampling,
    ) -> None:
        """Add a request for one sample of `prompt_token_ids`; `step` returns it under `key`,
        and gives `listener` each step's new tokens. `sampling`: the engine's other overrides
        (top_p, stop)."""
        request_id = f"stream-{next(_numbers)}"
        self.engine.submit(
            request_id,
            prompt_token_ids,
            seed=seed,
            max_tokens=max_tokens,
            temperature=temperature,
            **sampling,
        )
        self.live[request_id] = Live(key, listener)

    def __len__(self) -> int:
        """Requests in flight."""
        return len(self.live)

    def step(self) -> list[tuple[Hashable, Sample]]:
        """One engine step: the tokens it sampled join their requests, each tagged with the
        policy version that sampled it; the samples that finished, by key, in request order."""
        finished = []
        for delta in self.engine.step_outputs():
            live = self.live.get(delta.request_id)
            if live is None:  # aborted meanwhile
                continue
            live.token_ids += delta.token_ids
            live.logprobs += delta.logprobs
            live.versions += [delta.version] * len(delta.token_ids)
            if live.listener is not None and delta.token_ids:
                live.listener(delta.token_ids)
            if delta.finish_reason is not None:
                del self.live[delta.request_id]
                sample = Sample(
                    token_ids=live.token_ids,
                    logprobs=live.logprobs,
                    finish_reason=delta.finish_reason,
                    versions=live.versions,
                    routed_experts=delta.routed,
                )
                finished.append((int(delta.request_id.partition("-")[2]), live.key, sample))
        return [(key, sample) for _, key, sample in sorted(finished, key=lambda f: f[0])]

    def straddling(self) -> int:
        """Requests in flight that sampled tokens already: an update now splits them."""
        return sum(1 for live in self.live.values() if live.token_ids)

    def abort(self, keys: set) -> None:
        """Drop the requests in flight of `keys`."""
        ids = [request_id for request_id, live in self.live.items() if live.key in keys]
        self.engine.abort(ids)
        for request_id in ids:
            del self.live[request_id]


class AsyncStream:
    """A RequestStream on an event loop: `sample` is awaited by an episode; `step`, called by
    the loop that owns the engine (placements/continuous.py, which takes new weights between
    steps), resolves the samples that finished."""

    def __init__(self, stream: RequestStream):
        self.stream = stream
        self.waiting: dict[Hashable, asyncio.Future] = {}
        self._next = 0

    async def sample(
        self,
        prompt_token_ids: Sequence[int],
        *,
        seed: int,
        max_tokens: int,
        temperature: float | None = None,
        **options,
    ) -> Sample:
        """One sample of `prompt_token_ids`, when it finishes (`options`: RequestStream.submit's
        listener and sampling overrides)."""
        key = self._next
        self._next += 1
        future = asyncio.get_running_loop().create_future()
        self.waiting[key] = future
        self.stream.submit(
            key,
            prompt_token_ids,
            seed=seed,
            max_tokens=max_tokens,
            temperature=temperature,
            **options,
        )
        try:
            return await future
        except asyncio.CancelledError:
            # Its group was dropped (placements/continuous.py): free the engine.
            self.waiting.pop(key, None)
            self.stream.abort({key})
            raise

    def step(self) -> int:
        """One engine step; resolves the finished samples' futures; returns how many."""
        done = self.stream.step()
        for key, sample in done:
            self.waiting.pop(key).set_result(sample)
        return len(done)


class Lockstep:
    """Requests on a RequestStream turn by turn, as `Episodes.run` samples environments' turns:
    a batch of requests runs to its end, then the next batch goes in once every party still
    going (each agent's episode) has asked, in the parties' order. Requests then share engine
    batches (and the batch-dependent rounding of vLLM's kernels) exactly as an environment's
    batched turns do, so that an agent and the environment that does what it does sample the
    same tokens."""

    def __init__(self, stream: RequestStream):
        self.stream = stream
        self.asked: list[tuple[int, Sequence[int], dict, asyncio.Future]] = []
        self.changed = asyncio.Event()

    async def sample(self, order: int, prompt_token_ids: Sequence[int], **options) -> Sample:
        """One sample of `prompt_token_ids` for party `order`, once its batch ran."""
        future = asyncio.get_running_loop().create_future()
        self.asked.append((order, prompt_token_ids, options, future))
        self.changed.set()
        try:
            return await future
        except asyncio.CancelledError:
            self.asked = [a for a in self.asked if a[3] is not future]
            self.stream.abort({future})
            raise

    async def run(self, parties: list[asyncio.Future]) -> None:
        """Drive the engine until every party is done; then drop what they left asked or in
        flight (an agent server may answer before its last request did)."""
        for party in parties:
            party.add_done_callback(lambda _: self.changed.set())
        try:
            await self._run(parties)
        finally:
            for *_, future in self.asked:
                future.cancel()
            self.asked = []
            self.stream.abort({live.key for live in self.stream.live.values()})

    async def _run(self, parties: list[asyncio.Future]) -> None:
        while not all(p.done() for p in parties):
            if len(self.stream):
                for future, sample in self.stream.step():
                    if not future.done():
                        future.set_result(sample)
                await asyncio.sleep(0)
                continue
            going = sum(not p.done() for p in parties)
            if self.asked and len({a[0] for a in self.asked}) >= going:
                batch, self.asked = sorted(self.asked, key=lambda a: a[0]), []
                for _, prompt_token_ids, options, future in batch:
                    self.stream.submit(future, prompt_token_ids, **options)
                continue
            self.changed.clear()
            await self.changed.wait()
