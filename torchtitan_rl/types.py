"""The data that flows from generation to training, each type in this one home: a task's
`Prompt`; the generator's `Sample`s, as `Completions`; an episode run's `Scored` samples; a
rank's `Rollouts` of a step; the disaggregated placement's `Rollout` message; the trainer's
`RolloutBatch` and its `LossScale`.

    .venv/bin/python -m pytest tests/unit/test_algorithms.py tests/unit/test_imports.py

Nothing here imports another module of torchtitan_rl (tests/unit/test_imports.py): every stage
imports its types from here. Shapes: P prompts, N samples per prompt, B sequences, T tokens
(prompt + completion, right-padded).
"""

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import torch


@dataclass(frozen=True, slots=True)
class Images:
    """A prompt's images as a vision-language model reads them (Muse Glimmer's:
    vision/preprocess.py): their patch rows, grids, and where each image's run of placeholder
    tokens lies in the prompt's ids. A prompt's samples share one."""

    pixel_values_PX: torch.Tensor
    """Every image's patch rows, image after image, in HF's layout (vision/preprocess.py)."""
    grid_thw_N3: torch.Tensor
    """Each image's patch grid (1, h, w), int64."""
    starts: tuple[int, ...]
    """Where each image's placeholder run starts in the prompt's ids."""
    lengths: tuple[int, ...]
    """Each image's placeholder tokens (its merged patches)."""


@dataclass(frozen=True, slots=True)
class Prompt:
    text: str
    answer: str
    """What a reward function compares the completion with."""
    row: str = ""
    """Where the prompt comes from, for errors: "file:row" for dataset rows."""
    messages: tuple[dict, ...] | None = None
    """The row's chat messages ({"role", "content"}), when it has them; `text` is then the
    last user message's content."""
    source: str = ""
    """The name of the mixture's source it was drawn from (task.sources); "" in a run of one
    task."""
    images: tuple = ()
    """The row's images in the order its messages show them (paths, data URLs, bytes or PIL
    images), which the renderer reads; () for text."""


def is_chat(messages) -> bool:
    """Whether `messages` is a list of {"role": str, "content": str or a list of parts} chat
    messages (parts: OpenAI-style dicts with a "type": text, image or image_url)."""
    return isinstance(messages, list) and all(
        isinstance(m, dict)
        and isinstance(m.get("role"), str)
        and (
            isinstance(m.get("content"), str)
            or (
                isinstance(m.get("content"), list)
                and all(
                    isinstance(p, dict) and isinstance(p.get("type"), str) for p in m["content"]
                )
            )
        )
        for m in messages
    )


@dataclass(slots=True)
class Trace:
    """The ids of an episode after its first prompt, as sampled and as written between turns."""

    token_ids: list[int] = field(default_factory=list)
    """Every id after the first prompt: sampled turns and environment replies."""
    logprobs: list[float] = field(default_factory=list)
    sampled_mask: list[int] = field(default_factory=list)
    versions: list[int] | None = None
    """The policy version of each id (-1: the environment's), when a stream gave them."""
    routed: torch.Tensor | None = None
    """A mixture-of-experts generator's routing of the first prompt and `token_ids` so far
    (`Sample.routed_experts`: each turn's, merged)."""

    def route(self, routed: torch.Tensor | None) -> None:
        """Merge a turn's routing (its context and its completion): where the turn's request
        has none (its context's KV came from the prefix cache), the earlier turns' stands."""
        if routed is None or self.routed is None:
            self.routed = routed
            return
        known = self.routed[: len(routed), 0, 0] >= 0
        missing = routed[: len(known), 0, 0] < 0
        routed[: len(known)][missing & known] = self.routed[: len(routed)][missing & known]
        self.routed = routed

    def add(
        self,
        ids: Sequence[int],
        logprobs: Sequence[float] | None = None,
        versions: Sequence[int] | None = None,
    ) -> None:
        """Append sampled ids (with their logprobs, and their policy versions when a stream
        sampled them) or, without, the environment's."""
        if versions is not None and self.versions is None:
            self.versions = [-1] * len(self.token_ids)
        self.token_ids += ids
        self.logprobs += [0.0] * len(ids) if logprobs is None else logprobs
        self.sampled_mask += [int(logprobs is not None)] * len(ids)
        if self.versions is not None:
            self.versions += [-1] * len(ids) if versions is None else versions

    def routed_to(self, length: int) -> torch.Tensor | None:
        """The routing over `length` positions: the environment's last reply, which no turn
        ran, has none (-1)."""
        if self.routed is None or len(self.routed) >= length:
            return None if self.routed is None else self.routed[:length]
        pad = self.routed.new_full((length - len(self.routed), *self.routed.shape[1:]), -1)
        return torch.cat([self.routed, pad])


@dataclass(frozen=True, slots=True)
class Sample:
    """One completion of a prompt; for an episode (tasks.episodes), every token after the
    first prompt: the sampled turns and the environment's replies between them."""

    token_ids: list[int]
    logprobs: list[float]
    """Logprob of each sampled token under logits / temperature (0.0 for an environment's)."""
    finish_reason: str
    """"stop" (EOS or a stop token) or "length" (max_tokens reached; an episode: also cut by
    task.max_turns or generator.max_model_len)."""
    sampled_mask: list[int] | None = None
    """1 for each token the model sampled, 0 for each the environment wrote; None: all sampled."""
    messages: list[dict] | None = None
    """An episode's chat messages, roles and all (the rollout log's record of it)."""
    turns: int = 1
    """Assistant turns of the episode."""
    tool_calls: int = 0
    tool_errors: int = 0
    """Tool calls that were malformed or failed."""
    routed_experts: torch.Tensor | None = None
    """A mixture-of-experts generator's expert ids for every position of prompt + token_ids
    [T, M, K] (M: MoE layers, K: experts per token), int16, -1 where it ran none (the last
    token; KV served from the prefix cache); None for a dense model."""
    versions: list[int] | None = None
    """The policy version that sampled each token (-1 for an environment's); None where one
    version sampled them all (only a continuous generator updates weights mid-sample)."""
    images: Images | None = None
    """The episode's own images, placed in its prompt + token_ids: an agent's (those its
    requests sent, gateway/session.py), or its prompt's and then those its environment's
    replies brought; None: its prompt's (`Completions.images`)."""

    @property
    def sampled_tokens(self) -> int:
        if self.sampled_mask is None:
            return len(self.token_ids)
        return sum(self.sampled_mask)


@dataclass(frozen=True, slots=True)
class Delta:
    """What one engine step gave a streamed request (generator/stream.py)."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    version: int
    """The policy version that sampled these tokens."""
    finish_reason: str | None
    """None while the request goes on."""
    routed: torch.Tensor | None = None
    """At its finish, an MoE generator's routing of the request's prompt and tokens
    (`Sample.routed_experts`)."""


@dataclass(frozen=True, slots=True)
class Completions:
    """`samples[i]` holds the n samples of `prompts[i]`, in the order the prompts were given."""

    prompts: list[list[int]]
    samples: list[list[Sample]]
    images: "list[Images | None] | None" = None
    """Each prompt's images (None: text prompts)."""

    @property
    def num_tokens(self) -> int:
        """Sampled tokens (an environment's are not)."""
        return sum(s.sampled_tokens for group in self.samples for s in group)


@dataclass(frozen=True, slots=True)
class Scored:
    """What `Episodes.run` gives: the samples (Completions of the first prompts' ids), their
    rewards [P, N], and the seconds spent inside the environments."""

    completions: Completions
    rewards_PN: torch.Tensor
    env_s: float
    reward_parts_PN: dict[str, torch.Tensor] = field(default_factory=dict)
    """Each reward function's own values, by name, when a run has several (task.rewards)."""


@dataclass(slots=True)
class Rollouts:
    """Prompts, their N samples each and the task's rewards; groups in prompt order."""

    prompts: list[Prompt]
    completions: Completions
    rewards_PN: torch.Tensor
    """The task's reward of each sample (before any KL penalty)."""
    rounds: int = 1
    """Generation rounds it took (dynamic sampling), summed over its parts by `cat`."""
    parts: int = 1
    """How many ranks' rollouts `cat` joined into this one."""
    generated_groups: int | None = None
    """Groups generated over every round, kept or not (summed by `cat`); None: len(prompts)."""
    short_groups: int = 0
    """Groups without learning signal kept because the rounds ran out (dynamic sampling)."""
    env_s: float = 0.0
    """Seconds spent in the environments (rewards included; summed by `cat`)."""
    reward_parts_PN: dict[str, torch.Tensor] = field(default_factory=dict)
    """Each reward function's own values [P, N], by name (task.rewards with several)."""

    def __len__(self) -> int:
        return len(self.prompts)

    def lengths_PN(self) -> torch.Tensor:
        """Sampled tokens of each sample (stop tokens included, an environment's not)."""
        return torch.tensor([[s.sampled_tokens for s in g] for g in self.completions.samples])

    def truncated_PN(self) -> torch.Tensor:
        """True for each sample cut by max_tokens, or an episode by its limits (finish_reason
        "length")."""
        samples = self.completions.samples
        return torch.tensor([[s.finish_reason == "length" for s in g] for g in samples])

    @property
    def generated(self) -> int:
        """Groups generated over every round (`generated_groups`, or len(prompts))."""
        return len(self) if self.generated_groups is None else self.generated_groups

    def part(self, index: int, count: int) -> "Rollouts":
        """The `index`-th of `count` equal consecutive shares of the groups; the counts (rounds,
        generated and short groups) go with share 0 alone, so that summing the shares' counts
        over ranks counts them once; each share keeps the seconds spent in environments."""
        size = len(self) // count
        keep_P = torch.zeros(len(self), dtype=torch.bool)
        keep_P[index * size : (index + 1) * size] = True
        share = self.groups(keep_P)
        first = index == 0
        share.rounds, share.parts = (self.rounds, self.parts) if first else (0, 0)
        share.generated_groups = self.generated if first else 0
        share.short_groups = self.short_groups if first else 0
        share.env_s = self.env_s
        return share

    def groups(self, keep_P: torch.Tensor) -> "Rollouts":
        """The groups where `keep_P` is true, in order (counts not carried)."""
        index = keep_P.nonzero().flatten().tolist()
        return Rollouts(
            prompts=[self.prompts[i] for i in index],
            completions=Completions(
                prompts=[self.completions.prompts[i] for i in index],
                samples=[self.completions.samples[i] for i in index],
                images=None
                if self.completions.images is None
                else [self.completions.images[i] for i in index],
            ),
            rewards_PN=self.rewards_PN[keep_P],
            reward_parts_PN={k: v[keep_P] for k, v in self.reward_parts_PN.items()},
        )

    @staticmethod
    def cat(parts: list["Rollouts"]) -> "Rollouts":
        """The groups of every part, in order; counts add up."""
        return Rollouts(
            prompts=[p for part in parts for p in part.prompts],
            completions=Completions(
                prompts=[p for part in parts for p in part.completions.prompts],
                samples=[g for part in parts for g in part.completions.samples],
                images=None
                if all(part.completions.images is None for part in parts)
                else [
                    image
                    for part in parts
                    for image in part.completions.images or [None] * len(part.completions.prompts)
                ],
            ),
            rewards_PN=torch.cat([part.rewards_PN for part in parts]),
            rounds=sum(part.rounds for part in parts),
            parts=sum(part.parts for part in parts),
            generated_groups=sum(part.generated for part in parts),
            short_groups=sum(part.short_groups for part in parts),
            env_s=sum(part.env_s for part in parts),
            reward_parts_PN={
                name: torch.cat([part.reward_parts_PN[name] for part in parts])
                for name in parts[0].reward_parts_PN
            },
        )


@dataclass(slots=True)
class EvalShard:
    """One rank's (or several ranks' merged) evaluation of one policy version."""

    version: int
    totals: dict[str, float]
    """Sums over prompts and samples (see `Evaluator.run`), added up by `merge`."""
    samples: list[dict] = field(default_factory=list)
    seconds: float = 0.0

    @staticmethod
    def merge(shards: list["EvalShard"]) -> "EvalShard":
        return EvalShard(
            version=shards[0].version,
            totals={k: sum(s.totals[k] for s in shards) for k in shards[0].totals},
            samples=[x for s in shards for x in s.samples],
            seconds=max(s.seconds for s in shards),
        )

    def counted_elsewhere(self) -> "EvalShard":
        """This evaluation with nothing to add: zero totals, no samples, the same seconds (for
        a rank whose engine's evaluation another rank of it reports)."""
        zero = dict.fromkeys(self.totals, 0.0)
        return EvalShard(version=self.version, totals=zero, seconds=self.seconds)

    def metrics(self) -> dict[str, float]:
        """eval/* metrics of the summed totals."""
        t = self.totals
        samples, prompts = max(t["samples"], 1.0), max(t["prompts"], 1.0)
        metrics = {
            "eval/policy_version": float(self.version),
            "eval/accuracy": t["correct"] / samples,
            "eval/reward": t["reward"] / samples,
            "eval/response_length": t["tokens"] / samples,
            "eval/truncated_fraction": t["truncated"] / samples,
            "eval/tool_calls": t["tool_calls"] / samples,
            "eval/prompts": t["prompts"],
            "time/eval_s": self.seconds,
        }
        for key in sorted(k for k in t if k.startswith("pass@") and "/" not in k):
            metrics[f"eval/{key}"] = t[key] / prompts
        # Each reward function's mean over the samples it scored (evaluation.PART_TOTALS).
        for part in sorted(k.partition("/")[2] for k in t if k.startswith("part_samples/")):
            if t[f"part_samples/{part}"]:
                metrics[f"eval/reward/{part}"] = (
                    t[f"part_reward/{part}"] / t[f"part_samples/{part}"]
                )
        # A mixture's sources, each over its own eval set: totals named "correct/<source>".
        for source in sorted(k.partition("/")[2] for k in t if k.startswith("samples/")):
            samples, prompts = max(t[f"samples/{source}"], 1.0), max(t[f"prompts/{source}"], 1.0)
            metrics[f"eval/accuracy/{source}"] = t[f"correct/{source}"] / samples
            metrics[f"eval/response_length/{source}"] = t[f"tokens/{source}"] / samples
            for key in sorted(k for k in t if k.startswith("pass@") and k.endswith(f"/{source}")):
                metrics[f"eval/{key}"] = t[key] / prompts
        return metrics


@dataclass
class Rollout:
    """One generator rank's share of a step, as sent to its trainer rank."""

    step: int
    version: int
    weights_sha256: str | None
    """Digest of the generator's weights it sampled with (generator.verify_weight_sync)."""
    rollouts: Rollouts | None
    """None in the message after the last step, which carries only evaluations."""
    reward_errors: int
    generate_s: float
    evaluations: list[EvalShard]
    """This rank's evaluations of the policy versions it took since its previous message."""
    stop_requested: str | None = None
    """The signal that asked this generator rank to stop (watchdog.py): the trainers stop
    after the step, and tell the generators so."""
    groups: tuple[int, list[int]] | None = None
    """Continuous placement: the generator's shard, and its numbers of the groups it sent
    (their order of admission), which a checkpoint records."""
    figures: dict[str, float] | None = None
    """Continuous placement: the generator's own figures since its previous message."""


@dataclass(frozen=True, slots=True)
class LossScale:
    """Global totals of one step, over every micro-batch and data-parallel rank."""

    tokens: int
    """Loss-masked tokens in the whole step."""
    sequences: int
    """Sequences in the whole step."""


@dataclass(kw_only=True, slots=True)
class RolloutBatch:
    """One rank's training batch: right-padded sequences and what the loss needs of them.
    An SFT batch holds only tokens and the loss mask (its assistant tokens)."""

    tokens_BT: torch.Tensor
    """Prompt + completion token ids, right-padded, int64."""
    loss_mask_BT: torch.Tensor
    """1.0 where the token is a sampled completion token whose logprob is trained, else 0.0."""
    advantages_B: torch.Tensor | None = None
    """Advantage of each sequence (None in an SFT batch, which trains on demonstrations)."""
    generator_logprobs_BT: torch.Tensor | None = None
    """Logprob the generator reported for each sampled token (0 where loss_mask is 0; None in
    an SFT batch)."""
    reference_logprobs_BT: torch.Tensor | None = None
    """Logprob of each token under the frozen reference model (only with a KL penalty)."""
    token_advantages_BT: torch.Tensor | None = None
    """Advantage of each token added to its sequence's (only with a distill teacher in mode
    advantage: -distill.coef * the token's reverse KL to the teacher; 0 outside the loss mask
    and in rows whose source does not learn from the teacher)."""
    teacher_logprobs_BT: torch.Tensor | None = None
    """Logprob of each sampled token under the distill teacher (only in mode loss)."""
    distilled_B: torch.Tensor | None = None
    """1.0 for each sequence whose source learns from the teacher (only in mode loss)."""
    old_logprobs_BT: torch.Tensor | None = None
    """Logprob of each token under the policy before the batch's first update (only with
    several updates per batch; else the loss takes its own forward's, detached)."""
    routed_experts_BTMK: torch.Tensor | None = None
    """A mixture-of-experts generator's expert ids of each token in each MoE layer [B, T, M,
    K], int16, -1 where it has none (`Sample.routed_experts`); None for a dense model."""
    versions_BT: torch.Tensor | None = None
    """The policy version that sampled each token, int64, -1 where none did (continuous
    placement: `Sample.versions`); None where one version sampled the whole batch."""
    images_B: tuple[Images | None, ...] | None = None
    """Each row's prompt's images (None in a row without; None: no row has any). Host
    objects, not tensors: `to` and `map` leave them, and `rows` picks them by a host index."""

    @property
    def batch_size(self) -> int:
        return self.tokens_BT.shape[0]

    def split(self, n: int) -> list["RolloutBatch"]:
        """`n` micro-batches of consecutive rows (the last ones may be one row shorter)."""
        if not 1 <= n <= self.batch_size:
            raise ValueError(f"cannot split {self.batch_size} sequences into {n} micro-batches")
        parts = {name: torch.tensor_split(value, n) for name, value in self._tensors().items()}
        if self.images_B is not None:
            bounds = torch.arange(self.batch_size).tensor_split(n)
            parts["images_B"] = [tuple(self.images_B[int(b)] for b in rows) for rows in bounds]
        return [RolloutBatch(**{k: v[i] for k, v in parts.items()}) for i in range(n)]

    def _tensors(self) -> dict[str, torch.Tensor]:
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name != "images_B" and getattr(self, f.name) is not None
        }

    @staticmethod
    def cat(batches: list["RolloutBatch"]) -> "RolloutBatch":
        """The rows of `batches` in order, right-padded with 0 to the widest (the fields the
        first batch holds)."""
        width = max(b.tokens_BT.shape[1] for b in batches)
        names = list(batches[0]._tensors())

        def widened(name: str, tensor: torch.Tensor) -> torch.Tensor:
            if tensor.dim() < 2:
                return tensor
            fill = -1 if name == "routed_experts_BTMK" else 0  # unknown routing, not expert 0
            pad = (0, 0) * (tensor.dim() - 2) + (0, width - tensor.shape[1])
            return torch.nn.functional.pad(tensor, pad, value=fill)

        images_B = None
        if any(b.images_B is not None for b in batches):
            images_B = tuple(
                image for b in batches for image in b.images_B or (None,) * b.batch_size
            )
        return RolloutBatch(
            **{
                name: torch.cat([widened(name, getattr(b, name)) for b in batches])
                for name in names
            },
            images_B=images_B,
        )

    def rows(self, index_R: torch.Tensor) -> "RolloutBatch":
        """The batch of the rows `index_R`, in that order (a host index where the rows have
        images: picking them by a device index would read the device)."""
        picked = self.map(lambda tensor: tensor[index_R.to(tensor.device)])
        if self.images_B is None:
            return picked
        if index_R.device.type != "cpu":
            raise ValueError("the rows of a batch with images are picked by a host index")
        return dataclasses.replace(
            picked, images_B=tuple(self.images_B[i] for i in index_R.tolist())
        )

    def to(self, device: torch.device) -> "RolloutBatch":
        return self.map(lambda tensor: tensor.to(device))

    def map(self, fn) -> "RolloutBatch":
        """`fn` applied to every tensor the batch holds (its images stay as they are)."""
        mapped = {name: fn(value) for name, value in self._tensors().items()}
        return RolloutBatch(**mapped, images_B=self.images_B)


def rollout_batch(
    prompts: list[list[int]],
    samples: "list[list[Sample]]",
    advantages_PN: torch.Tensor,
    pad_id: int,
    images: "list[Images | None] | None" = None,
) -> RolloutBatch:
    """Right-padded RolloutBatch of every (prompt, sample) pair, prompt-major; `images`: each
    prompt's (Completions.images), shared by its samples' rows but those that carry their own
    (`Sample.images`).

    `samples[p][n]` is the n-th sample of prompt p (an episode: its turns and the environment's
    replies between them); the loss mask covers exactly the sampled tokens (a sampled stop
    token included, an environment's tokens not), with the generator's logprobs there.
    """
    rows, masks, logprobs, advantages = [], [], [], []
    for p, prompt in enumerate(prompts):
        for n, sample in enumerate(samples[p]):
            sampled = sample.sampled_mask or [1] * len(sample.token_ids)
            rows.append(prompt + sample.token_ids)
            masks.append([0.0] * len(prompt) + [float(m) for m in sampled])
            logprobs.append([0.0] * len(prompt) + list(sample.logprobs))
            advantages.append(float(advantages_PN[p, n]))
    width = max(len(r) for r in rows)

    def pad(values: list, fill) -> list:
        return values + [fill] * (width - len(values))

    return RolloutBatch(
        tokens_BT=torch.tensor([pad(r, pad_id) for r in rows], dtype=torch.long),
        loss_mask_BT=torch.tensor([pad(m, 0.0) for m in masks]),
        advantages_B=torch.tensor(advantages),
        generator_logprobs_BT=torch.tensor([pad(lp, 0.0) for lp in logprobs]),
        routed_experts_BTMK=_routed(samples, width),
        versions_BT=_versions(prompts, samples, width),
        images_B=_row_images(samples, images),
    )


def _row_images(samples: "list[list[Sample]]", images: "list[Images | None] | None"):
    """Each row's images, prompt-major: its sample's own, else its prompt's (None: no row has
    any)."""
    images = images or [None] * len(samples)
    rows = tuple(
        images[p] if sample.images is None else sample.images
        for p, group in enumerate(samples)
        for sample in group
    )
    return None if all(i is None for i in rows) else rows


def _versions(
    prompts: list[list[int]], samples: "list[list[Sample]]", width: int
) -> torch.Tensor | None:
    """The samples' token versions, prompt-major, -1 on prompts and padding (None: no sample
    has them)."""
    if all(s.versions is None for group in samples for s in group):
        return None
    rows = [
        [-1] * len(prompt) + (s.versions or [-1] * len(s.token_ids))
        for prompt, group in zip(prompts, samples, strict=True)
        for s in group
    ]
    return torch.tensor([row + [-1] * (width - len(row)) for row in rows], dtype=torch.long)


def _routed(samples: "list[list[Sample]]", width: int) -> torch.Tensor | None:
    """The samples' routing, prompt-major, right-padded with -1 to `width` (None: dense)."""
    routed = [s.routed_experts for group in samples for s in group]
    if not routed or routed[0] is None:
        return None
    _, M, K = routed[0].shape
    out_BTMK = torch.full((len(routed), width, M, K), -1, dtype=torch.int16)
    for b, routed_TMK in enumerate(routed):
        out_BTMK[b, : routed_TMK.shape[0]] = routed_TMK
    return out_BTMK
