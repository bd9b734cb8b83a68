"""Generator vs trainer logprobs under several batch compositions, after real RL steps.

    torchrun --standalone --nproc_per_node 2 tests/dist/batch_invariant_run.py OUT.json \
        NAME --job.config_file run_configs/debug_cpu.toml --batch_invariant true ... \
        [--then NAME2 --job.config_file ...]

Trains the given config's steps (each step logs logprob_diff/max), then on the trained weights
measures max |generator - trainer| logprob of the sampled tokens for: prompts of mixed lengths
(3 to 200 tokens, across vLLM's 128-token CPU KV block) sampled together; one prompt alone;
the same prompt among 16 concurrent sequences. Several runs go one after another in the same
world (`--then`). Rank 0 writes {NAME: figures} to OUT.json, with what the run's engine
compiled (its graphs and their host reads: helpers/compiled_graphs.py). A run's flag
`--plant_plain_reduction` (this script's, not the config's) plants a defect for that run: its
row-parallel layers reduce as without a TP side (one GEMM; a TP generator's rank sums its
plain partial product over the ranks), which a test expects to break bitwise equality;
`--plant_ranks_sum`: an expert-parallel generator's ranks each add their own experts' share of
a token, then the shares are summed over the ranks (`ranks_sum`).
"""

import gc
import json
import random
import sys

import torch
import torch.distributed as dist
from helpers import compiled_graphs
from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

from torchtitan_rl import batch_invariant, platform
from torchtitan_rl.config import parse_args
from torchtitan_rl.generator import tensor_parallel
from torchtitan_rl.loop import Hooks
from torchtitan_rl.placements.colocated import RLTrainer
from torchtitan_rl.types import rollout_batch


class StepDiffs(Hooks):
    def __init__(self):
        self.steps = []

    def after_step(self, step, metrics):
        self.steps.append({k: metrics[k] for k in ("logprob_diff/max", "offpolicy/ratio_max")})


def digits(rng: random.Random, count: int) -> str:
    return "".join(rng.choice("0123456789") for _ in range(count))


def max_diff(
    run: RLTrainer, prompts: list[str], seed: int, n: int = 2, max_tokens: int = 6
) -> tuple[float, list]:
    """Sample n completions of each prompt in one generate call; the largest |generator -
    trainer| logprob over every sampled token (all ranks), and the first sample's logprobs."""
    ids = [run.producer.renderer.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    completions = run.generator.generate(ids, n=n, max_tokens=max_tokens, seed=seed)
    batch = rollout_batch(ids, completions.samples, torch.zeros(len(ids), n), run.learner.pad_id)
    trainer_BT, _ = run.learner.trainer.logprobs(batch.tokens_BT)
    diff = ((trainer_BT - batch.generator_logprobs_BT).abs() * batch.loss_mask_BT).max()
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return float(diff), completions.samples[0][0].logprobs


def ranks_sum(self, routed_output_RD, metadata, x_TD):
    """The planted `RankExperts.combine`: each rank adds its own experts' share of a token,
    then the shares are summed over the ranks (the plain expert-parallel order)."""
    mine_RD = torch.where(metadata.mine_N[:, None], routed_output_RD, 0)
    return self.sum_rows(LocalTokenDispatcher.combine(self, mine_RD, metadata, x_TD))


def main() -> None:
    out, runs = sys.argv[1], split_runs(sys.argv[2:])
    platform.patch_torchtitan()
    rank, world_size = platform.init_distributed()
    results = {}
    for name, flags in runs:
        results[name] = probe(flags, rank, world_size)
        gc.collect()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    platform.shutdown_distributed()


def split_runs(args: list[str]) -> list[tuple[str, list[str]]]:
    """`NAME flags... [--then NAME flags...]` -> [(name, flags), ...]: runs one after another in
    this world (a torchrun world and its imports cost ~20 s to start)."""
    runs: list[tuple[str, list[str]]] = []
    named = False  # whether the run being read has its name yet
    for arg in args:
        if arg == "--then":
            named = False
        elif not named:
            runs.append((arg, []))
            named = True
        else:
            runs[-1][1].append(arg)
    return runs


def probe(flags: list[str], rank: int, world_size: int) -> dict:
    """One run's RL steps, then the probes on its trained weights: its figures (rank 0's)."""
    recorder = StepDiffs()
    planted = "--plant_plain_reduction" in flags
    planted_ranks_sum = "--plant_ranks_sum" in flags
    flags = [f for f in flags if f not in ("--plant_plain_reduction", "--plant_ranks_sum")]
    config = parse_args(flags, world_size)
    with compiled_graphs.recording() as graphs:  # the engine's, over the run and the probes
        saved = batch_invariant.reduction_slices, tensor_parallel.RankExperts.combine
        if planted:
            batch_invariant.reduction_slices = lambda *degrees: 1
        if planted_ranks_sum:
            tensor_parallel.RankExperts.combine = ranks_sum
        try:
            run = RLTrainer(config, hooks=recorder)
        finally:
            batch_invariant.reduction_slices, tensor_parallel.RankExperts.combine = saved
        run.train()
        rng = random.Random(7)
        mixed = [f"echo {digits(rng, n)}:" for n in (3, 17, 64, 121, 130, 200)]
        target = f"echo {digits(rng, 40)}:"
        crowd = [target] + [f"echo {digits(rng, rng.randint(2, 90))}:" for _ in range(7)]
        mixed_diff, _ = max_diff(run, mixed, seed=11)
        alone_diff, alone_logprobs = max_diff(run, [target], seed=13)
        # 8 prompts x 2 samples = 16 concurrent sequences; the target is request 0 again,
        # with the same per-request seed.
        crowd_diff, crowd_logprobs = max_diff(run, crowd, seed=13)
    run.generator.close()  # the next run builds its own engine in this world
    return {
        "steps": recorder.steps,
        "mixed_lengths": mixed_diff,
        "alone": alone_diff,
        "among_16": crowd_diff,
        "alone_equals_among_16": alone_logprobs == crowd_logprobs,
        "engine_compiled": run.generator.compiled,
        "graphs": compiled_graphs.summary(graphs),
        "longest_prompt_tokens": len(
            run.producer.renderer.tokenizer.encode(mixed[-1], add_special_tokens=False)
        ),
    }


if __name__ == "__main__":
    main()
    platform.exit_process(0)
