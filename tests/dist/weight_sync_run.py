"""Train one step, sync the weights into the generator, and check what the generator samples with.

    torchrun --standalone --nproc_per_node 2 tests/dist/weight_sync_run.py OUT_DIR
    python tests/dist/weight_sync_run.py OUT_DIR                 (a world of one)

Each rank: FSDP trainer + its own vLLM replica of the tiny checkpoint. A 150-token prompt is
generated before the step so its first KV block sits in the prefix cache. After the step the
weights are copied without the cache reset (to show the stale KV), then synced properly.
Results go to OUT_DIR/rank{r}.pt.
"""

import sys
from pathlib import Path

import torch

from torchtitan_rl import platform
from torchtitan_rl.batch import RolloutBatch
from torchtitan_rl.config.job_config import (
    GeneratorSection,
    ModelSection,
    ParallelismSection,
    TrainingSection,
)
from torchtitan_rl.generator.engine import Generator
from torchtitan_rl.trainer.policy_trainer import LossScale, PolicyTrainer
from torchtitan_rl.weight_sync import WeightSync

TINY = str(Path(__file__).resolve().parents[2] / "assets" / "tiny_qwen3")
TEMPERATURE = 0.8


def pg_loss(logprobs_BT, batch: RolloutBatch, scale: LossScale):
    weighted_BT = batch.advantages_B[:, None] * logprobs_BT * batch.loss_mask_BT
    return -weighted_BT.sum() / scale.tokens, {}


def max_logprob_diff(trainer, prompt, completions) -> float:
    """Largest |generator - trainer| logprob over the sampled tokens of `completions`."""
    worst = 0.0
    for sample in completions.samples[0]:
        tokens_BT = torch.tensor([prompt + sample.token_ids])
        logprobs_BT, _ = trainer.logprobs(tokens_BT)
        recomputed = logprobs_BT[0, len(prompt) :]
        worst = max(worst, float((recomputed - torch.tensor(sample.logprobs)).abs().max()))
    return worst


def main() -> None:
    out = Path(sys.argv[1])
    platform.patch_torchtitan()
    rank, world = platform.init_distributed()
    model = ModelSection(hf_checkpoint=TINY)
    trainer = PolicyTrainer(
        model=model,
        training=TrainingSection(lr=2e-2, max_grad_norm=0.0),
        parallelism=ParallelismSection(),
        temperature=TEMPERATURE,
    )
    generator = Generator(generator=GeneratorSection(max_model_len=256), model=model, seed=rank)
    sync = WeightSync.between(trainer, generator, bucket_mb=0.1, verify=True)

    g = torch.Generator().manual_seed(rank)
    long_prompt = torch.randint(3, 64, (150,), generator=g).tolist()
    short_prompt = torch.randint(3, 64, (7,), generator=g).tolist()

    def sample(prompt):
        return generator.generate([prompt], n=4, temperature=TEMPERATURE, max_tokens=10, seed=3)

    before = sample(long_prompt)  # fills the prefix cache with old-weight KV
    diff_before_step = max_logprob_diff(trainer, long_prompt, before)

    # One real optimizer step on a batch of the generator's own samples.
    tokens = [long_prompt[-20:] + s.token_ids for s in before.samples[0]]
    width = max(len(t) for t in tokens)
    tokens_BT = torch.tensor([t + [0] * (width - len(t)) for t in tokens])
    mask_BT = torch.zeros(tokens_BT.shape)
    for b, t in enumerate(tokens):
        mask_BT[b, 20 : len(t)] = 1.0
    batch = RolloutBatch(
        tokens_BT=tokens_BT,
        loss_mask_BT=mask_BT,
        advantages_B=torch.tensor([1.0, -1.0, 0.5, -0.5]),
        generator_logprobs_BT=torch.zeros(tokens_BT.shape),
    )
    trainer.train_step(batch, pg_loss)
    stale_params = sum(
        not torch.equal(generator.named_parameters()[k], p.full_tensor())
        for k, p in trainer.named_parameters().items()
    )

    # Copy without resetting the prefix cache: the cached block still holds old-weight KV.
    sync.copy()
    generator.repack_weights()
    diff_stale_cache = max_logprob_diff(trainer, long_prompt, sample(long_prompt))

    stats = sync.sync(trainer, generator)
    mismatched = [
        name
        for name, param in trainer.named_parameters().items()
        if not torch.equal(generator.named_parameters()[name], param.full_tensor())
    ]
    diff_long = max_logprob_diff(trainer, long_prompt, sample(long_prompt))
    diff_short = max_logprob_diff(trainer, short_prompt, sample(short_prompt))
    torch.save(
        {
            "world": world,
            "diff_before_step": diff_before_step,
            "stale_params_before_sync": stale_params,
            "diff_stale_cache": diff_stale_cache,
            "diff_long": diff_long,
            "diff_short": diff_short,
            "mismatched_after_sync": mismatched,
            "num_params": len(trainer.named_parameters()),
            "stats": stats,
            "num_buckets": len(sync.buckets),
            "versions": (trainer.policy_version, generator.policy_version),
        },
        out / f"rank{rank}.pt",
    )
    platform.shutdown_distributed()


if __name__ == "__main__":
    main()
    platform.exit_process(0)  # also skips vLLM's slow teardown
