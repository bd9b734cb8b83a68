"""Held-out evaluation on the generator: accuracy (mean@n), unbiased pass@k, response length.

    .venv/bin/python -m pytest tests/*/test_eval.py

Every rank evaluates a contiguous shard of the eval prompts and the shards' totals are summed.
A sample is correct when its reward is at least 1 (math-verify's 1.0; a custom reward_fn
should give 1 for a right answer). Sampling seeds belong to the prompt (its index in the eval
set), not to the step, the rank or the batch: the same policy on the same data gives the same
samples, in the run and in scripts/eval.py.
"""

import math
import time
from collections.abc import Callable

import torch

from torchtitan_rl import platform
from torchtitan_rl.config import EvalSection, JobConfig
from torchtitan_rl.episodes import Episodes, OpenTask
from torchtitan_rl.generator.base import Generator
from torchtitan_rl.tasks.render import Renderer
from torchtitan_rl.types import EvalShard, Prompt

# The totals summed for each source of a mixture as well ("name/source"), pass@k's too.
SOURCE_TOTALS = ("prompts", "samples", "correct", "tokens")

# Each reward function's sum and sample count ("part_reward/<function>"), when the scorer
# gives their own values: eval/reward/<function>.
PART_TOTALS = ("part_reward", "part_samples")

# Eval seeds: their own range, far from the training samples' (RLTrainer.sampling_seed).
EVAL_SEED_BASE = 2**61


def pass_at_k(n: int, correct: int, k: int) -> float:
    """Unbiased pass@k of one prompt with `correct` of `n` samples right (Chen et al. 2021):
    1 - C(n - c, k) / C(n, k)."""
    if n - correct < k:
        return 1.0
    return 1.0 - math.comb(n - correct, k) / math.comb(n, k)


def pass_ks(n: int) -> list[int]:
    """The k of eval/pass@k: 1, 2, 4, ... up to n."""
    return [2**i for i in range(n.bit_length()) if 2**i <= n]


def all_reduce(shard: EvalShard, group=None) -> None:
    """Sum `shard`'s totals over the ranks of `group` (the same keys on every rank)."""
    keys = sorted(shard.totals)
    values = torch.tensor([shard.totals[k] for k in keys], dtype=torch.float64)
    platform.all_reduce_host(values, group=group)
    shard.totals = dict(zip(keys, values.tolist(), strict=True))


def log_eval(metrics, step: int, shards: list[EvalShard], group=None) -> dict[str, float]:
    """Sum the evaluations `shards` (this rank's) over the ranks of `group`, and log them at
    `step` with `metrics` (a MetricsLogger: rank 0 writes)."""
    result = EvalShard.merge(shards)
    all_reduce(result, group)
    figures = result.metrics()
    metrics.log_eval(step, figures, result.samples)
    return figures


def eval_due(section: EvalSection, step: int, last: int) -> bool:
    """Whether the weights after `step` (0: the starting ones) are evaluated, in a run of
    `last` steps: at the start (eval.at_start), every eval.interval steps and at the end."""
    if step == 0:
        return section.at_start
    return step == last or (section.interval > 0 and step % section.interval == 0)


class Evaluator:
    """Runs the eval prompts' episodes on a generator (the task's environment: one scored turn
    for a single-turn task)."""

    def __init__(
        self,
        section: EvalSection,
        prompts: list[Prompt],
        renderer_of: Callable[[Prompt], Renderer],
        episodes: Episodes,
        *,
        seed: int,
        max_tokens: int,
    ):
        """`renderer_of(prompt)`: the renderer of the prompt's source; `max_tokens`:
        generator.sampling.max_tokens, used when eval.max_tokens is unset."""
        self.section, self.prompts, self.renderer_of = section, prompts, renderer_of
        # A mixture's evaluated sources: their figures are summed apart too (name/source).
        self.sources = sorted({p.source for p in prompts} - {""})
        self.episodes = episodes
        # The reward functions whose own values the scorer gives (task.rewards, a
        # reasoning_gym source's extracted and raw scores): each one's mean is a figure too.
        self.parts = episodes.scorer.names
        self.seed = EVAL_SEED_BASE + seed * 2**32
        self.max_tokens = section.max_tokens or max_tokens

    def due(self, version: int, last: int) -> bool:
        """Whether policy `version` (the weights after that step) is evaluated."""
        return eval_due(self.section, version, last)

    def run(self, generator: Generator, version: int, shard: int = 0, shards: int = 1) -> EvalShard:
        """This rank's shard of the eval set sampled with `generator` and scored: an EvalShard
        with totals prompts, samples, correct, reward, tokens, truncated and pass@k sums."""
        began = time.perf_counter()
        n = self.section.n
        first, end = shard * len(self.prompts) // shards, (shard + 1) * len(self.prompts) // shards
        prompts = self.prompts[first:end]
        names = ["prompts", "samples", "correct", "reward", "tokens", "truncated", "tool_calls"]
        passes = [f"pass@{k}" for k in pass_ks(n)]
        totals = dict.fromkeys(names + passes, 0.0)
        by_source = [*SOURCE_TOTALS, *passes]
        totals |= dict.fromkeys((f"{x}/{s}" for s in self.sources for x in by_source), 0.0)
        totals |= dict.fromkeys((f"{x}/{p}" for p in self.parts for x in PART_TOTALS), 0.0)
        samples, logged = [], {}  # logged: samples kept of each source (a mixture's)
        if prompts:
            scored = self.episodes.run(
                generator,
                prompts,
                n=n,
                temperature=self.section.temperature,
                max_tokens=self.max_tokens,
                seed=self.seed + first * n,  # request i takes seed + i * n: the prompt's own
            )
            groups = zip(prompts, scored.completions.samples, scored.rewards_PN, strict=True)
            for i, (prompt, group, rewards_N) in enumerate(groups):
                renderer = self.renderer_of(prompt)
                texts = [renderer.decode(s.token_ids) for s in group]
                rewards = rewards_N.tolist()
                correct = sum(r >= 1.0 for r in rewards)
                figures = {
                    "prompts": 1,
                    "samples": n,
                    "correct": correct,
                    "reward": sum(rewards),
                    "tokens": sum(s.sampled_tokens for s in group),
                    "truncated": sum(s.finish_reason == "length" for s in group),
                    "tool_calls": sum(s.tool_calls for s in group),
                    **{f"pass@{k}": pass_at_k(n, correct, k) for k in pass_ks(n)},
                }
                for name, value in figures.items():
                    totals[name] += value
                    if prompt.source and name in by_source:
                        totals[f"{name}/{prompt.source}"] += value
                # NaN: a sample its source's functions do not score.
                parts = {p: v[i].tolist() for p, v in scored.reward_parts_PN.items()}
                parts = {p: v for p, v in parts.items() if not math.isnan(v[0])}
                for part, values in parts.items():
                    totals[f"part_reward/{part}"] += sum(values)
                    totals[f"part_samples/{part}"] += len(values)
                if logged.get(prompt.source, 0) < self.section.log_samples:
                    logged[prompt.source] = logged.get(prompt.source, 0) + 1
                    samples.append(
                        {
                            **({"source": prompt.source} if prompt.source else {}),
                            "prompt": renderer.text(prompt),
                            "answer": prompt.answer,
                            "completions": texts,
                            "messages": [s.messages for s in group],
                            "rewards": rewards,
                            **({"reward_parts": parts} if parts else {}),
                            "token_ids": [list(s.token_ids) for s in group],
                        }
                    )
        return EvalShard(version, totals, samples, time.perf_counter() - began)


def build_evaluator(config: JobConfig, opened: OpenTask) -> Evaluator | None:
    """The run's evaluator (its eval set, the task's renderer and scorer); None without one."""
    if not opened.eval_prompts:
        return None
    return Evaluator(
        config.eval,
        opened.eval_prompts,
        opened.renderer_of,
        opened.episodes,
        seed=config.job.seed,
        max_tokens=config.generator.sampling.max_tokens,
    )
