"""A mixture-of-experts RL run through the train entry point, then checks on its trained
weights that need the live trainer and generator.

    torchrun --standalone --nproc_per_node 2 tests/dist/moe_run.py PROMPT MAX_TOKENS \
        --job.config_file run_configs/debug_cpu.toml --model.flavor tiny_moe ...

After training (everything `python -m torchtitan_rl.train` does with the flags), rank 0 writes
{job.dump_folder}/moe.json:
- `greedy`: the token ids the generator holding the final weights picks greedily for PROMPT;
- `bias_*`: the routers' load-balancing bias made nonzero in the trainer (as a checkpoint
  trained with torchtitan's balancing would hold), then one full weight sync: whether the
  generator's buffers equal it, and max |generator - trainer| logprob of sampled tokens before
  and after (the bias moves routing, so both sides must read it);
- `expert_shards`, `generator_expert_shards`: the experts each rank's trainer and generator hold
  (expert parallel);
- `synced_each_step`: what weight sync sends after its first sync (what a step changes);
- `replay`: on a fresh batch, the trainer's routing and logprobs against the generator's with
  router replay off and on.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from tokenizers import Tokenizer
from torch.distributed.tensor import DTensor

from torchtitan_rl import platform, train
from torchtitan_rl.placements.colocated import RLTrainer
from torchtitan_rl.types import rollout_batch


def whole(t: torch.Tensor) -> torch.Tensor:
    """A sharded generator's tensor gathered whole (a plain one as is)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def local(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of a tensor (a plain one: all of it)."""
    return t.to_local() if isinstance(t, DTensor) else t


def max_diff(run: RLTrainer, ids: list[list[int]]) -> tuple[float, list]:
    completions = run.generator.generate(ids, n=4, max_tokens=6, seed=3)
    batch = rollout_batch(ids, completions.samples, torch.zeros(len(ids), 4), run.learner.pad_id)
    trainer_BT, _ = run.learner.trainer.logprobs(batch.tokens_BT)
    diff = ((trainer_BT - batch.generator_logprobs_BT).abs() * batch.loss_mask_BT).max()
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return float(diff), completions.samples[0][0].logprobs


def replay_checks(run: RLTrainer, ids: list[list[int]]) -> dict:
    """On one fresh batch: the trainer's routing and logprobs against the generator's, with
    router replay off and on (mismatched and compared (token, layer) pairs, max and mean
    |generator - trainer| logprob of the sampled tokens; summed or maxed over ranks)."""
    completions = run.generator.generate(ids, n=8, max_tokens=6, seed=5)
    batch = rollout_batch(ids, completions.samples, torch.zeros(len(ids), 8), run.learner.pad_id)
    trainer, result = run.learner.trainer, {}
    configured = trainer.router_replay
    trainer.routing_counts()
    for replay in (False, True):
        trainer.router_replay = replay
        trainer_BT, _ = trainer.logprobs(batch.tokens_BT, routed_BTMK=batch.routed_experts_BTMK)
        diff_BT = (trainer_BT - batch.generator_logprobs_BT).abs() * batch.loss_mask_BT
        sums = torch.tensor(
            [*trainer.routing_counts(), float(diff_BT.sum()), float(batch.loss_mask_BT.sum())],
            dtype=torch.float64,
        )
        largest = diff_BT.max()
        dist.all_reduce(sums)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)
        result["on" if replay else "off"] = {
            "mismatched": int(sums[0]),
            "compared": int(sums[1]),
            "diff_mean": float(sums[2] / sums[3]),
            "diff_max": float(largest),
        }
    trainer.router_replay = configured
    return result


def checks(run: RLTrainer, prompt: str, max_tokens: int) -> dict:
    config = run.config
    tokenizer = Tokenizer.from_file(str(Path(config.model.tokenizer_dir) / "tokenizer.json"))
    ids = [tokenizer.encode(p).ids for p in (prompt, "echo 4:", "echo 98765:")]
    greedy = run.generator.generate([ids[0]], n=1, temperature=0.0, max_tokens=max_tokens)
    replay = replay_checks(run, [tokenizer.encode(f"echo {i * 7919}:").ids for i in range(16)])
    trainer = run.learner.trainer
    expert_weight = trainer.named_parameters()["layers.0.moe.routed_experts.inner_experts.w1_EFD"]
    before, logprobs_before = max_diff(run, ids)
    biases = {n: t for n, t in trainer.sync_sources().items() if n.endswith("expert_bias_E")}
    generator_weights = run.generator.weights()
    generator_experts = generator_weights["layers.0.moe.routed_experts.inner_experts.w1_EFD"]
    with torch.no_grad():
        for name, bias in biases.items():
            bias.copy_(torch.linspace(-0.3, 0.3, bias.numel()))  # the same on every rank
    run.transport.copier.copy(everything=True)
    run.generator.refresh_after_weight_update()
    after, logprobs_after = max_diff(run, ids)
    return {
        "greedy": greedy.samples[0][0].token_ids,
        "replay": replay,
        "bias_names": sorted(biases),
        "bias_synced": all(torch.equal(whole(generator_weights[n]), b) for n, b in biases.items()),
        "bias_diff_before": before,
        "bias_diff_after": after,
        "bias_moved_logprobs": logprobs_before != logprobs_after,
        "expert_shards": [tuple(expert_weight.to_local().shape), tuple(expert_weight.shape)],
        "generator_expert_shards": [
            tuple(local(generator_experts).shape),
            tuple(generator_experts.shape),
        ],
        "synced_each_step": sorted(
            {name for bucket in run.transport.copier.update_buckets for name, _, _ in bucket}
        ),
    }


def main() -> int:
    prompt, max_tokens, flags = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    train_only = RLTrainer.train

    def train_then_check(run: RLTrainer) -> None:
        train_only(run)
        result = checks(run, prompt, max_tokens)
        if run.rank == 0:
            (Path(run.config.job.dump_folder) / "moe.json").write_text(json.dumps(result))

    RLTrainer.train = train_then_check
    return train.main(flags)


if __name__ == "__main__":
    platform.exit_process(main())
