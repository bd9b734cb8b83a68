"""Episodes: prompts -> environments -> turns of generation, token-exact, -> scored samples.

    .venv/bin/python -m pytest tests/*/test_envs.py

Every rollout is an episode (a single-turn task is the one-step case, `tasks.env.SingleTurn`).
An episode's ids are never re-encoded: turn k+1's prompt is turn k's prompt, plus the ids the
model sampled (its stop id included), plus the environment's reply rendered on its own with the
chat template (`Renderer.reply_ids`). The training sequence is the whole episode: the first
prompt, then `Sample.token_ids`, where `sampled_mask` marks what the model sampled (trained)
and what the environment wrote (not). Decoding and re-encoding a turn could give other ids than
the model sampled (tests/unit/test_envs.py builds such a case); then the trainer would score tokens
the generator never chose.

The episodes of a step run together: one batched generate call per turn over the episodes
still going, and their environments' steps concurrently (asyncio), each within
task.env_timeout_s. In continuous placement each group runs as coroutines on the engine's
request stream instead (`run_group`): an episode's next turn goes in as soon as its
environment answers. A step that raises or times out scores like a failing reward function
(task.reward_on_error). An episode ends when its environment says done, or as truncated
(finish_reason "length") when a turn hits max_tokens, task.max_turns runs out, or the next
turn would not fit generator.max_model_len.

An agent task's episodes (task.name = agent) are driven by their agents instead, through the
gateway's sessions (torchtitan_rl/gateway), seeded as environments' turns are and, in colocated
and disaggregated placement, batched as they are (`generator.stream.Lockstep`): an agent and an
environment that do the same sample the same tokens. An episode is then what its session
recorded (`_take`).
"""

import asyncio
import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from torchtitan_rl.config import ConfigError, JobConfig
from torchtitan_rl.gateway.protocol import Parsers, load_parsers
from torchtitan_rl.gateway.server import MODEL, Gateway, Opened
from torchtitan_rl.gateway.session import Segment
from torchtitan_rl.generator.base import Generator
from torchtitan_rl.generator.stream import AsyncStream, Lockstep, RequestStream
from torchtitan_rl.models import checkpoint_stop_ids
from torchtitan_rl.tasks import Task, build_task, dataset_keys
from torchtitan_rl.tasks.agent import Agent, Endpoint, load_agent, row_of
from torchtitan_rl.tasks.dataset import read_rows
from torchtitan_rl.tasks.env import Environment, EnvStep, SingleTurn, load_env
from torchtitan_rl.tasks.mixture import Mixture
from torchtitan_rl.tasks.reasoning_gym import ReasoningGymTask
from torchtitan_rl.tasks.render import Renderer, build_renderer, image_reader
from torchtitan_rl.tasks.rewards import Reward, RewardError, Scorer, load_rewards
from torchtitan_rl.types import Completions, Images, Prompt, Sample, Scored, Trace, is_chat
from torchtitan_rl.vision.prompts import image_parts, join_images


@dataclass(frozen=True, slots=True)
class Source:
    """What one source of prompts (the task, or a source of task.sources) brings to its
    episodes: how its prompts render, its environment, and its turn limit."""

    renderer: Renderer
    make_env: Callable[[], Environment]
    max_turns: int
    agent: Agent | None = None
    """An agent task's agent (tasks.agent), which drives its episodes through the gateway."""
    parsers: Parsers | None = None
    """An agent task's tool-call and reasoning parsers."""


@dataclass(slots=True)
class Episode(Trace):
    """One episode in progress."""

    prompt: Prompt | None = None
    source: Source | None = None
    env: Environment | None = None
    """None for an agent's episode (tasks.agent), which the gateway records."""
    messages: list[dict] = field(default_factory=list)
    """Every message so far, the system prompt's and the opening ones included."""
    tools: list[dict] | None = None
    images: Images | None = None
    """The images of the episode's context (its first prompt, then its turns): the first
    prompt's, then those its environment's replies brought; an agent's episode: its
    session's, placed in its first ids and turns."""
    own_images: bool = False
    """Whether `images` are the episode's own, which its sample carries (an agent's, or an
    environment's replies brought some), rather than its prompt's, which the group shares."""
    reward: float = 0.0
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    first_ids: list[int] = field(default_factory=list)
    """An agent's episode: the first prompt of the segment it trains on (gateway/session.py)."""
    finish: str = "stop"
    """An agent's episode: how it ended."""
    by_reward_fn: bool = False
    """An agent's episode whose reward the task's reward function gives (the agent gave none)."""

    def sample(self, finish_reason: str, first_prompt_length: int) -> Sample:
        return Sample(
            token_ids=self.token_ids,
            logprobs=self.logprobs,
            finish_reason=finish_reason,
            sampled_mask=self.sampled_mask,
            messages=self.messages,
            turns=self.turns,
            tool_calls=self.tool_calls,
            tool_errors=self.tool_errors,
            routed_experts=self.routed_to(first_prompt_length + len(self.token_ids)),
            versions=self.versions,
            images=self.images if self.own_images else None,
        )


class Episodes:
    """Runs the episodes of a batch of prompts on a generator (see the module docstring)."""

    def __init__(
        self,
        sources: dict[str, Source],
        scorer: Scorer,
        *,
        stop_ids: list[int],
        max_model_len: int,
        timeout_s: float,
        gateway: Gateway | None = None,
    ):
        """`sources[prompt.source]` runs the episodes of each prompt ("": a run of one task).
        `stop_ids`: the checkpoint's stop tokens (a turn may also end on a stop string)."""
        self.sources, self.scorer = sources, scorer
        self.stop_ids = set(stop_ids)
        self.max_model_len, self.timeout_s = max_model_len, timeout_s
        self.gateway = gateway
        """The OpenAI-compatible server of agent tasks' sessions (None without agents)."""
        self._loop: asyncio.Runner | None = None

    def run(
        self,
        generator: Generator,
        prompts: list[Prompt],
        *,
        seed: int,
        n: int,
        max_tokens: int,
        temperature: float | None = None,
    ) -> Scored:
        """`n` episodes of each prompt on `generator` (a LocalGenerator or RemoteGenerator).
        Sample j of prompt p: first turn as `generator.generate(seed=seed)` gives it, each
        later turn t seeded by (seed + p * n + j, t), so it depends on nothing else."""
        if self._loop is None:
            # One event loop for the run's episodes: an environment may keep loop-bound
            # clients (HTTP sessions, sandboxes) between steps and episodes.
            self._loop = asyncio.Runner()
        return self._loop.run(self._run(generator, prompts, seed, n, temperature, max_tokens))

    async def _run(self, generator: Generator, prompts, seed, n, temperature, max_tokens) -> Scored:
        if self.gateway is not None:
            lockstep = Lockstep(RequestStream(generator))
            return await self._agents(
                lockstep.sample, lockstep.run, prompts, seed, n, temperature, max_tokens
            )
        env_s = 0.0
        began = time.perf_counter()
        groups = [[self._open(p) for _ in range(n)] for p in prompts]
        first_ids, images = await self._reset(groups)
        env_s += time.perf_counter() - began
        completions = generator.generate(
            first_ids,
            n=n,
            temperature=temperature,
            max_tokens=max_tokens,
            seed=seed,
            **_with(images),
        )
        live = [
            (episode, sample, first_ids[p], seed + p * n + j)
            for p, (group, samples) in enumerate(zip(groups, completions.samples, strict=True))
            for j, (episode, sample) in enumerate(zip(group, samples, strict=True))
        ]
        finish: dict[int, str] = {}
        while live:
            began = time.perf_counter()
            steps = await asyncio.gather(*(self._step(episode, s) for episode, s, *_ in live))
            env_s += time.perf_counter() - began
            going = []
            for (episode, sample, prompt_ids, episode_seed), step in zip(live, steps, strict=True):
                episode.route(sample.routed_experts)
                ended = self._end(episode, sample, step, len(prompt_ids))
                if ended is not None:
                    finish[id(episode)] = ended
                else:
                    going.append((episode, prompt_ids, episode_seed))
            if not going:
                break
            contexts = [prompt_ids + episode.token_ids for episode, prompt_ids, _ in going]
            following = generator.generate(
                contexts,
                n=1,
                temperature=temperature,
                max_tokens=[min(max_tokens, self.max_model_len - len(c)) for c in contexts],
                seed=[(s * 1_000_003 + e.turns) % 2**62 for e, _, s in going],
                **_with([episode.images for episode, _, _ in going]),
            )
            live = [
                (episode, group[0], prompt_ids, episode_seed)
                for (episode, prompt_ids, episode_seed), group in zip(
                    going, following.samples, strict=True
                )
            ]
        began = time.perf_counter()
        parts_PN = await self._score(groups)
        env_s += time.perf_counter() - began
        samples = [
            [e.sample(finish[id(e)], len(first_ids[p])) for e in group]
            for p, group in enumerate(groups)
        ]
        rewards_PN = torch.tensor([[e.reward for e in group] for group in groups])
        return Scored(
            Completions(first_ids, samples, _with(images).get("images")),
            rewards_PN,
            env_s,
            parts_PN,
        )

    async def run_group(
        self,
        stream: AsyncStream,
        prompt: Prompt,
        *,
        seed: int,
        n: int,
        max_tokens: int,
        temperature: float | None = None,
    ) -> Scored:
        """The `n` episodes of `prompt` as coroutines on `stream` (generator.stream.AsyncStream,
        continuous placement): each submits its next turn as soon as its environment answers,
        with no barrier across episodes. Seeded as `run` seeds them, so that at one policy
        version the samples are the ones `run` gives."""
        if self.gateway is not None:
            # The loop that owns the stream steps it (placements/continuous.py).
            return await self._agents(
                lambda _, *args, **kwargs: stream.sample(*args, **kwargs),
                lambda parties: asyncio.gather(*parties),
                [prompt],
                seed,
                n,
                temperature,
                max_tokens,
            )
        env_s = 0.0
        began = time.perf_counter()
        group = [self._open(prompt) for _ in range(n)]
        (first_ids,), (images,) = await self._reset([group])
        env_s += time.perf_counter() - began

        async def episode(j: int, episode: Episode) -> tuple[str, float]:
            episode_seed, spent = seed + j, 0.0
            sample = await stream.sample(
                first_ids,
                seed=episode_seed,
                max_tokens=max_tokens,
                temperature=temperature,
                **_with_one(images),
            )
            while True:
                began = time.perf_counter()
                step = await self._step(episode, sample)
                spent += time.perf_counter() - began
                ended = self._end(episode, sample, step, len(first_ids))
                if ended is not None:
                    return ended, spent
                context = first_ids + episode.token_ids
                sample = await stream.sample(
                    context,
                    seed=(episode_seed * 1_000_003 + episode.turns) % 2**62,
                    max_tokens=min(max_tokens, self.max_model_len - len(context)),
                    temperature=temperature,
                    **_with_one(episode.images),
                )

        ended = await asyncio.gather(*(episode(j, e) for j, e in enumerate(group)))
        began = time.perf_counter()
        parts_PN = await self._score([group])
        env_s += time.perf_counter() - began + max(spent for _, spent in ended)
        samples = [
            e.sample(finish, len(first_ids)) for e, (finish, _) in zip(group, ended, strict=True)
        ]
        rewards_PN = torch.tensor([[e.reward for e in group]])
        completions = Completions([first_ids], [samples], _with([images]).get("images"))
        return Scored(completions, rewards_PN, env_s, parts_PN)

    async def _agents(self, sample, drive, prompts, seed, n, temperature, max_tokens) -> Scored:
        """The episodes of an agent task: `n` agents per prompt, each on a gateway session
        whose turns `sample` samples (seeded as an environment's turns), while `drive(parties)`
        runs the engine until they are all done."""
        await self.gateway.start()
        groups = [[self._open(p) for _ in range(n)] for p in prompts]
        opened = [
            [
                self.gateway.open(
                    e.source.renderer,
                    e.source.parsers,
                    seed=seed + p * n + j,
                    order=p * n + j,
                    sample=_defaults(sample, temperature, max_tokens),
                    max_turns=e.source.max_turns,
                )
                for j, e in enumerate(group)
            ]
            for p, group in enumerate(groups)
        ]
        parties = [
            asyncio.ensure_future(self._agent(e, url, session))
            for group, sessions in zip(groups, opened, strict=True)
            for e, (url, session) in zip(group, sessions, strict=True)
        ]
        try:
            await drive(parties)
        finally:
            for party in parties:
                party.cancel()
        unscored = [e for group in groups for e in group if e.by_reward_fn]
        if unscored:  # the agents that left their reward to the task's reward function
            rewards, _ = await self.scorer.score(
                [e.prompt for e in unscored],
                [e.messages[-1].get("content") or "" for e in unscored],
            )
            for episode, reward in zip(unscored, rewards, strict=True):
                episode.reward = reward
        first_ids = [_shared_prompt(group) for group in groups]
        samples = [
            [e.sample(e.finish, len(first_ids[p])) for e in group] for p, group in enumerate(groups)
        ]
        rewards_PN = torch.tensor([[e.reward for e in group] for group in groups])
        env_s = max(p.result() for p in parties)  # the longest an agent worked, not waiting
        return Scored(Completions(first_ids, samples), rewards_PN, env_s, {})

    async def _agent(self, episode: Episode, url: str, opened: Opened) -> float:
        """Run an episode's agent on its session, within task.env_timeout_s of idleness; take
        the session's record into `episode`. The seconds it ran outside its requests."""
        source, prompt = episode.source, episode.prompt
        endpoint = Endpoint(url, opened.key, MODEL)
        agent = asyncio.ensure_future(
            source.agent(endpoint, row_of(prompt, source.renderer.messages(prompt)))
        )
        reward, failed, began = None, None, time.monotonic()
        try:
            while not agent.done():
                await asyncio.wait({agent}, timeout=self.timeout_s or None)
                idle = time.monotonic() - opened.idle_since
                if not agent.done() and opened.in_flight == 0 and 0 < self.timeout_s <= idle:
                    agent.cancel()
                    failed = (
                        f"the agent made no request for longer than task.env_timeout_s = "
                        f"{self.timeout_s:g} s"
                    )
            if failed is None:
                reward = agent.result()
        except asyncio.CancelledError:
            if failed is None:
                raise
        except RewardError:
            raise
        except Exception as e:  # user code: any exception is the agent's failure
            failed = f"the agent raised {e!r}"
        finally:
            agent.cancel()
            self.gateway.close(opened)
        if opened.session.final() is None:
            # Nothing sampled to train on: the opening prompt and a stop id, none of it trained.
            failed = failed or "the agent made no chat request to its session"
            (first_ids,), (images,) = source.renderer.encode_images([prompt])
            segment = Segment(first_ids=first_ids, images=images)
            segment.add([min(self.stop_ids)])
            opened.session.segments.append(segment)
        _take(episode, opened)
        if failed is not None:
            episode.reward = self.scorer.failed(failed, prompt, None)
        elif reward is not None or opened.reward is not None:
            episode.reward = float(reward if reward is not None else opened.reward)
        else:
            episode.by_reward_fn = True
        return time.monotonic() - began - opened.waited_s

    def _open(self, prompt: Prompt) -> Episode:
        source = self.sources[prompt.source]
        env = None if source.agent is not None else source.make_env()
        return Episode(prompt=prompt, source=source, env=env)

    async def _score(self, groups: list[list[Episode]]) -> dict[str, torch.Tensor]:
        """Score the answers of single-turn episodes, all at once (a source's batched and
        async reward functions take them together); each reward function's values [P, N] by
        name, when the run has several (NaN where a sample is not its function's)."""
        episodes = [e for group in groups for e in group]
        # An environment gave its episodes' rewards; every single-turn episode took one
        # answer (SingleTurn.step cannot fail).
        answered = [e for e in episodes if isinstance(e.env, SingleTurn)]
        prompts, answers = [e.prompt for e in answered], [e.env.answer for e in answered]
        rewards, parts = [], {name: [] for name in self.scorer.names}
        if answered:
            rewards, parts = await self.scorer.score(prompts, answers)
        for episode, reward in zip(answered, rewards, strict=True):
            episode.reward += reward
        shape = (len(groups), len(groups[0]))
        where = {id(e): i for i, e in enumerate(answered)}
        return {
            name: torch.tensor(
                [values[where[id(e)]] if id(e) in where else math.nan for e in episodes]
            ).view(shape)
            for name, values in parts.items()
        }

    async def _reset(
        self, groups: list[list[Episode]]
    ) -> tuple[list[list[int]], list[Images | None]]:
        """Open every episode; the first prompt's ids of each group, and its images."""
        try:
            opened = await asyncio.gather(
                *(self._call(e.env.reset(e.prompt), "reset") for group in groups for e in group)
            )
        except _EnvFailed as e:
            # Without its opening there is no prompt to sample: the run stops, naming it.
            raise RewardError(f"task.env: {e}") from e.__cause__
        first_ids, first_images = [], []
        for p, group in enumerate(groups):
            mine = opened[p * len(group) : (p + 1) * len(group)]
            try:
                messages, tools = mine[0]
                _check_messages(messages, "reset")
            except (TypeError, ValueError, _EnvFailed) as e:
                raise RewardError(f"task.env: reset() must return (messages, tools): {e}") from None
            if any(other != mine[0] for other in mine[1:]):
                raise ConfigError(
                    f"task.env: reset() opened the episodes of one prompt differently "
                    f"({group[0].prompt.row or group[0].prompt.text!r}); a group's episodes "
                    "must start alike (GRPO compares them): make reset depend on the row only"
                )
            # The images are those of the messages the environment opened with.
            prompt = dataclasses.replace(
                group[0].prompt, messages=tuple(messages), images=tuple(image_parts(messages))
            )
            renderer = group[0].source.renderer
            (ids,), (images,) = renderer.encode_images([prompt], tools=tools)
            for episode in group:
                episode.messages = renderer.messages(prompt)
                episode.tools = tools
                episode.images = images
            first_ids.append(ids)
            first_images.append(images)
        return first_ids, first_images

    async def _call(self, coroutine, what: str):
        """Await an environment's `what` (reset or step) within task.env_timeout_s."""
        try:
            # A deadline on this task (no task of its own per call, unlike wait_for).
            async with asyncio.timeout(self.timeout_s if self.timeout_s > 0 else None):
                return await coroutine
        except RewardError:
            raise  # the task's reward failed under reward_on_error = "fail": already one line
        except TimeoutError:
            raise _EnvFailed(
                f"the environment's {what} took longer than task.env_timeout_s = "
                f"{self.timeout_s:g} s"
            ) from None
        except Exception as e:  # user code: any exception is the environment's failure
            raise _EnvFailed(f"the environment's {what} raised {e!r}") from e

    async def _step(self, episode: Episode, sample: Sample) -> EnvStep | None:
        """Add the sampled turn to `episode` and give it to its environment; None when the
        environment failed (scored by task.reward_on_error)."""
        episode.add(sample.token_ids, sample.logprobs, sample.versions)
        episode.turns += 1
        message = {"role": "assistant", "content": episode.source.renderer.decode(sample.token_ids)}
        try:
            step = await self._call(episode.env.step(message), "step")
            _check_step(step)
        except _EnvFailed as e:
            episode.reward = self.scorer.failed(str(e), episode.prompt, e.__cause__)
            step = None
        episode.messages.append(message)
        return step

    def _end(
        self, episode: Episode, sample: Sample, step: EnvStep | None, prompt_len: int
    ) -> str | None:
        """Take the environment's `step` into `episode`: how it ended ("stop" or "length"),
        or None when it goes on (the reply's ids then added)."""
        if step is None:
            return sample.finish_reason
        episode.reward += step.reward
        episode.tool_calls += step.tool_calls
        episode.tool_errors += step.tool_errors
        if step.done:
            return sample.finish_reason
        if sample.finish_reason != "stop" or episode.turns >= episode.source.max_turns:
            return "length"
        last = sample.token_ids[-1] if sample.token_ids else None
        try:
            reply_ids, images = episode.source.renderer.encode_reply(
                episode.messages[:-1],
                step.messages,
                episode.tools,
                stop_id=last if last in self.stop_ids else None,
            )
        except ConfigError:
            raise  # the chat template's (it cannot grow an episode): the run stops on it
        except ValueError as e:  # an image the model cannot read: the environment's failure
            failed = f"the environment's step replied with an image the model cannot read: {e}"
            episode.reward = self.scorer.failed(failed, episode.prompt, e)
            return sample.finish_reason
        context_len = prompt_len + len(episode.token_ids)
        if context_len + len(reply_ids) >= self.max_model_len:
            return "length"
        if images is not None:
            episode.images = join_images(episode.images, images, context_len)
            episode.own_images = True
        episode.add(reply_ids)
        episode.messages += step.messages
        return None


def _defaults(sample, temperature: float | None, max_tokens: int):
    """A driver's `sample` with the run's sampling where a request gives none: its temperature,
    and at most `max_tokens` (and the room the prompt leaves) per turn."""

    async def sample_with(order: int, prompt_ids: list[int], **options) -> Sample:
        if options["temperature"] is None:
            options["temperature"] = temperature
        options["max_tokens"] = min(options["max_tokens"] or max_tokens, options.pop("room"))
        return await sample(order, prompt_ids, **options)

    return sample_with


def _take(episode: Episode, opened: Opened) -> None:
    """An agent's episode as its session recorded it: the segment a request continued last."""
    session = opened.session
    segment = session.final()
    episode.first_ids = segment.first_ids
    episode.token_ids, episode.logprobs = segment.token_ids, segment.logprobs
    episode.sampled_mask, episode.versions = segment.sampled_mask, segment.versions
    episode.routed = segment.routed
    episode.messages, episode.tools = segment.sent, segment.tools
    episode.images, episode.own_images = segment.images, True
    episode.turns = session.turns
    episode.tool_calls, episode.tool_errors = opened.tool_calls, opened.ill_formed_tool_calls
    # A last turn that called tools no request answered: the episode was cut, as an
    # environment's episode is when its turns run out.
    episode.finish = "length" if segment.waits_for_tool else segment.finish_reason


def _shared_prompt(group: list[Episode]) -> list[int]:
    """The first prompt of a group of agents' episodes: the longest start their first prompts
    share; the rest of each is its episode's first ids (not sampled)."""
    shared = group[0].first_ids
    for episode in group[1:]:
        same = next(
            (i for i, (a, b) in enumerate(zip(shared, episode.first_ids, strict=False)) if a != b),
            min(len(shared), len(episode.first_ids)),
        )
        shared = shared[:same]
    if not shared:
        raise ConfigError(
            "task.agent: the agents of one prompt opened with prompts that share no token; a "
            "group's episodes must start alike (GRPO compares them): build the first messages "
            "from the row only"
        )
    for episode in group:
        rest = episode.first_ids[len(shared) :]
        if rest:  # the prompt's, not sampled
            episode.token_ids = rest + episode.token_ids
            episode.logprobs = [0.0] * len(rest) + episode.logprobs
            episode.sampled_mask = [0] * len(rest) + episode.sampled_mask
            if episode.versions is not None:
                episode.versions = [-1] * len(rest) + episode.versions
    return list(shared)


class _EnvFailed(Exception):
    """An environment's reset or step raised, timed out or answered something malformed."""


def _check_messages(messages, what: str) -> None:
    """Chat messages as an environment must give them: a list of {"role": str, "content":
    str or a list of parts} dicts."""
    if not is_chat(messages):
        raise _EnvFailed(
            f"the environment's {what} gave {messages!r:.80}, not a list of "
            '{"role": str, "content": str or [{"type": ...}, ...]} messages'
        )
    try:
        image_parts(messages)
    except ValueError as e:
        raise _EnvFailed(f"the environment's {what} gave {e}") from None


def _check_step(step) -> None:
    if not isinstance(step, EnvStep):
        raise _EnvFailed(f"the environment's step returned {step!r:.80}, not an EnvStep")
    if not step.done:
        _check_messages(step.messages, "step")


@dataclass(slots=True)
class OpenTask:
    """What a run needs of its task section, opened and checked: the prompts' task (a Mixture
    with task.sources), each source's renderer, environment and turn limit, the scorer, the
    episode runner, and the held-out eval prompts (each tagged with its source; empty without
    an eval set)."""

    task: Task
    sources: dict[str, Source]
    scorer: Scorer
    episodes: Episodes
    eval_prompts: list[Prompt]

    @property
    def renderer(self) -> Renderer:
        """The first source's renderer. Every source shares the checkpoint's tokenizer, so it
        decodes any completion; `renderer_of` renders a prompt as its source does."""
        return next(iter(self.sources.values())).renderer

    def renderer_of(self, prompt: Prompt) -> Renderer:
        return self.sources[prompt.source].renderer


def open_task(config: JobConfig) -> OpenTask:
    """Open the task of `config`, every source of a mixture: read and check every dataset row
    (file:row), render every prompt (too long after the chat template?), import the reward
    functions. Runs before any model or engine is built, so bad data fails in seconds with one
    line."""
    section = config.task
    tasks, sources, rewards, eval_prompts = {}, {}, {}, []
    for name, source in section.named_sources.items():
        at = f"task.sources.{name}" if name else "task"
        tasks[name] = build_task(source, seed=config.job.seed, at=at)
        renderer = build_renderer(
            source,
            config.model.tokenizer_dir,
            config.training.max_prompt_len,
            at=at,
            images=image_reader(config.model),
        )
        rewards[name] = load_rewards(source.reward_fn, source.rewards, at)
        generated = isinstance(tasks[name], ReasoningGymTask)
        if generated and not rewards[name]:  # its score of the extracted answer, and the raw
            rewards[name] = tasks[name].rewards(name)
        make_env, agent, parsers = SingleTurn, None, None
        if source.name == "env":
            make_env = load_env(source.env, source.env_kwargs, at)
        if source.name == "agent":
            agent = load_agent(source.agent, source.agent_url, at)
            parsers = load_parsers(
                renderer.tokenizer, source.tool_parser, source.reasoning_parser, at
            )
        sources[name] = Source(renderer, make_env, source.turns, agent, parsers)
        held_out = tasks[name].held_out if generated else []  # generated with its own seed
        eval_path = source.eval_dataset_path if name else config.eval.dataset_path
        if eval_path is not None:
            field = f"{at}.eval_dataset_path" if name else "eval.dataset_path"
            held_out = read_rows(eval_path, dataset_keys(source, at), field)
        eval_prompts += [dataclasses.replace(p, source=name) for p in held_out]
        renderer.encode(tasks[name].every_prompt() + held_out)  # each fits, or one line says which
    _check_reward_names(rewards)
    if section.sources:
        weights = {name: source.weight for name, source in section.sources.items()}
        task = Mixture(tasks, weights, seed=config.job.seed)
    else:
        task = tasks[""]
    scorer = Scorer(
        task,
        rewards,
        section.reward_on_error,
        section.reward_timeout_s,
        log_each=any(
            s.rewards or s.name == "reasoning_gym" for s in section.named_sources.values()
        ),
    )
    stop_ids = checkpoint_stop_ids(
        config.model.hf_checkpoint or config.model.tokenizer_dir,
        "model.hf_checkpoint" if config.model.hf_checkpoint else "model.tokenizer_path",
    )
    agents = [name for name, source in sources.items() if source.agent is not None]
    if agents and len(agents) != len(sources):
        raise ConfigError(
            f"task.sources.{agents[0]} is an agent task beside sources that are not: a run's "
            "episodes are all agents' or none (its generator is driven one way); run them apart"
        )
    gateway = None
    if agents:
        gateway = Gateway(
            stop_ids=set(stop_ids),
            max_model_len=config.generator.max_model_len,
            host=section.gateway_host,
            port=section.gateway_port,
        )
    episodes = Episodes(
        sources,
        scorer,
        stop_ids=stop_ids,
        max_model_len=config.generator.max_model_len,
        timeout_s=section.env_timeout_s,
        gateway=gateway,
    )
    return OpenTask(task, sources, scorer, episodes, eval_prompts)


def _check_reward_names(rewards: dict[str, list[Reward]]) -> None:
    """Sources may share a reward function (one reward/<name> figure over their samples), but
    two different functions of one name would log as one figure."""
    seen: dict[str, tuple[str, Reward]] = {}
    for source, loaded in rewards.items():
        for reward in loaded:
            other = seen.setdefault(reward.name, (source, reward))
            if other[1].fn is not reward.fn:
                raise ConfigError(
                    f"task.sources.{source}.rewards and task.sources.{other[0]}.rewards name two "
                    f"different functions called {reward.name!r}: both would log as "
                    f"reward/{reward.name}; rename one"
                )


def _with(images: list) -> dict:
    """The `images` keyword of a generate call whose prompts have `images` (none when none
    has any: a text-only generator takes no such keyword)."""
    return {} if all(i is None for i in images) else {"images": images}


def _with_one(images: Images | None) -> dict:
    """The `images` keyword of one request (`AsyncStream.sample`)."""
    return {} if images is None else {"images": images}
