"""RolloutProducer: a rank's prompts of a step -> episodes on a generator -> scored Rollouts,
used alike by every placement (colocated ranks, disaggregated generator ranks).

    .venv/bin/python -m pytest tests/unit/test_rl_trainer.py

Prompts and sampling seeds are functions of (job.seed, step, shard), not of the placement or
of batching: a run samples the same rollouts colocated or disaggregated, and again on resume.
With dynamic sampling, further rounds of prompts until the shard has as many groups with
learning signal (algorithm.dynamic_sampling). Shapes: P prompts, N samples per prompt.
"""

from contextlib import contextmanager

import torch

from torchtitan_rl.algorithms.advantages import zero_variance_P
from torchtitan_rl.algorithms.dynamic_sampling import fill_informative
from torchtitan_rl.config import JobConfig
from torchtitan_rl.episodes import OpenTask
from torchtitan_rl.errors import EngineError
from torchtitan_rl.evaluation import build_evaluator
from torchtitan_rl.generator.base import Generator
from torchtitan_rl.trainer.policy_trainer import NonFiniteError
from torchtitan_rl.types import EvalShard, Prompt, Rollouts


class RolloutProducer:
    """The task side of a generating rank. Its engine (one per rank, or one per
    generator.parallelism.tensor_parallel_degree consecutive ranks: `engine_of`) samples shard
    `shard` of `shards` of the prompts; every rank of an engine runs the same episodes, keeps
    its part of the engine's rollouts, and only the engine's first rank counts its evaluation
    and reward errors."""

    def __init__(self, config: JobConfig, task: OpenTask, rank: int, ranks: int):
        """`rank` of the `ranks` that generate."""
        self.config = config
        self.shard, self.engine_rank, self.shards = config.generator.parallelism.engine_of(
            rank, ranks
        )
        self.engine_ranks = config.generator.parallelism.tensor_parallel_degree
        self.task, self.renderer, self.scorer = task.task, task.renderer, task.scorer
        self.episodes = task.episodes
        self.evaluator = build_evaluator(config, task)

    @property
    def reward_errors(self) -> int:
        """Rewards that failed so far (task.reward_on_error scored them)."""
        return self.scorer.errors

    @reward_errors.setter
    def reward_errors(self, count: int) -> None:
        self.scorer.errors = count  # restored on resume

    @property
    def counted_reward_errors(self) -> int:
        """`reward_errors` as this rank adds them up with the others': its engine's first rank
        counts them (every rank of an engine scores the same samples)."""
        return self.reward_errors if self.engine_rank == 0 else 0

    def prompts(self, step: int, round: int = 0) -> list[Prompt]:
        """This shard's contiguous share of the step's global prompts (of a dynamic-sampling
        `round` > 0: further ones)."""
        per_shard = self.config.training.prompts_per_step // self.shards
        prompts = self.task.prompts(step, per_shard * self.shards, round)
        return prompts[self.shard * per_shard : (self.shard + 1) * per_shard]

    def sampling_seed(self, step: int, round: int = 0) -> int:
        # Per-request seeds: samples depend on (seed, step, shard, prompt), not on batching.
        # Each (step, shard) owns 2**20 consecutive seeds, one per sample (LocalGenerator.generate);
        # a dynamic-sampling round takes the ones after the previous round's.
        run = (self.config.job.seed * 1_000_003 + step) * 4_096 + self.shard
        per_round = self.config.training.prompts_per_step // self.shards
        return (run * 2**20 + round * per_round * self.config.generator.sampling.n) % 2**62

    def rollouts(self, step: int, generator: Generator) -> Rollouts:
        """This rank's part of its engine's rollouts of the step (`Rollouts.part`)."""
        engine_rollouts = self.engine_rollouts(step, generator)
        if self.engine_ranks == 1:
            return engine_rollouts
        return engine_rollouts.part(self.engine_rank, self.engine_ranks)

    def engine_rollouts(self, step: int, generator: Generator) -> Rollouts:
        """This shard's prompts of the step, their episodes run on `generator` and scored
        (one turn each for a single-turn task)."""
        algorithm = self.config.algorithm
        sampling = self.config.generator.sampling
        rounds: list[Rollouts] = []
        for round in range(algorithm.max_generation_rounds):
            prompts = self.prompts(step, round)
            with engine_failure_at(f"step {step}"):
                scored = self.episodes.run(
                    generator,
                    prompts,
                    seed=self.sampling_seed(step, round),
                    n=sampling.n,
                    max_tokens=sampling.max_tokens,
                )
            check_rewards(step, scored.rewards_PN)
            rounds.append(
                Rollouts(
                    prompts,
                    scored.completions,
                    scored.rewards_PN,
                    env_s=scored.env_s,
                    reward_parts_PN=scored.reward_parts_PN,
                )
            )
            if not algorithm.dynamic_sampling:
                return rounds[0]
            informative = sum(int((~zero_variance_P(r.rewards_PN)).sum()) for r in rounds)
            if informative >= len(prompts):
                break
        return fill_informative(rounds, wanted=len(rounds[0]))

    def eval_due(self, version: int) -> bool:
        """Whether the policy after step `version` (0: the starting one) is evaluated."""
        steps = self.config.training.steps
        return self.evaluator is not None and self.evaluator.due(version, steps)

    def evaluate(self, generator: Generator, version: int) -> EvalShard:
        """This shard's evaluation of `generator`'s policy (after step `version`), as this rank
        adds it up with the others': counted by its engine's first rank."""
        with engine_failure_at(f"evaluating the policy after step {version}"):
            result = self.evaluator.run(generator, version, self.shard, self.shards)
        return result if self.engine_rank == 0 else result.counted_elsewhere()


@contextmanager
def engine_failure_at(where: str):
    """Name where an engine failure happened (the step) in its one line."""
    try:
        yield
    except EngineError as e:
        raise EngineError(f"{where}: {e}") from e.__cause__


def check_rewards(step: int, rewards_PN: torch.Tensor) -> None:
    """A NaN/inf reward stops the run."""
    if not bool(torch.isfinite(rewards_PN).all()):
        raise NonFiniteError(f"step {step}: a reward is not finite: {rewards_PN.tolist()}")
