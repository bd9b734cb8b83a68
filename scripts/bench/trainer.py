"""Benchmark PolicyTrainer.train_step against a plain torchtitan step on the same model and batch.

    .venv/bin/torchrun --standalone --nproc_per_node 2 scripts/bench/trainer.py --flavor tiny

Both sides use the trainer's FSDP-sharded model and torchtitan optimizer: "plain" is forward,
torchtitan's `cross_entropy_loss`, backward, grad clipping, optimizer and LR-scheduler step;
"ours" is `train_step` with a token-mean policy-gradient loss. Steps alternate between the two
so machine noise hits both alike. Rank 0 prints one JSON line: median tokens/s of each, and
`ratio` = ours / plain (target >= 0.95).
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torchtitan.components.loss import cross_entropy_loss
from torchtitan.distributed import utils as dist_utils

from torchtitan_rl import platform
from torchtitan_rl.batch import RolloutBatch
from torchtitan_rl.config.job_config import ModelSection, ParallelismSection, TrainingSection
from torchtitan_rl.trainer.policy_trainer import LossScale, PolicyTrainer

REPO = Path(__file__).resolve().parents[2]


def pg_loss(logprobs_BT: torch.Tensor, batch: RolloutBatch, scale: LossScale):
    weighted_BT = batch.advantages_B[:, None] * logprobs_BT * batch.loss_mask_BT
    return -weighted_BT.sum() / scale.tokens, {}


def plain_step(trainer: PolicyTrainer, tokens_BT: torch.Tensor, max_norm: float) -> None:
    positions_BT = torch.arange(tokens_BT.shape[1]).expand_as(tokens_BT)
    logits_BTV = trainer.model(tokens_BT, positions_BT, None)
    loss = cross_entropy_loss(logits_BTV[:, :-1], tokens_BT[:, 1:]) / tokens_BT[:, 1:].numel()
    loss.backward()
    dist_utils.clip_grad_norm_(list(trainer.model.parameters()), max_norm=max_norm)
    trainer.optimizers.step()
    trainer.lr_schedulers.step()
    trainer.optimizers.zero_grad()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="tiny", help="qwen3 flavor: tiny or debugmodel")
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=10, help="timed steps of each kind")
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()

    platform.patch_torchtitan()
    rank, world = platform.init_distributed()
    checkpoint = REPO / "assets" / "tiny_qwen3"
    model = ModelSection(
        flavor=args.flavor,
        hf_checkpoint=str(checkpoint) if args.flavor == "tiny" else None,
        tokenizer_path=str(checkpoint),
    )
    training = TrainingSection(lr=1e-4, steps=10_000, max_grad_norm=1.0)
    trainer = PolicyTrainer(model=model, training=training, parallelism=ParallelismSection())
    vocab = trainer.spec.model.vocab_size
    g = torch.Generator().manual_seed(rank)
    tokens_BT = torch.randint(0, vocab, (args.batch, args.seq), generator=g)
    batch = RolloutBatch(
        tokens_BT=tokens_BT,
        loss_mask_BT=torch.ones(args.batch, args.seq),
        advantages_B=torch.randn(args.batch, generator=g),
        generator_logprobs_BT=torch.zeros(args.batch, args.seq),
    )

    times: dict[str, list[float]] = {"ours": [], "plain": []}
    for i in range(args.warmup + args.steps):
        for kind in ("ours", "plain"):
            dist.barrier()
            start = time.perf_counter()
            if kind == "ours":
                trainer.train_step(batch, pg_loss)
            else:
                plain_step(trainer, tokens_BT, training.max_grad_norm)
            dist.barrier()
            if i >= args.warmup:
                times[kind].append(time.perf_counter() - start)

    tokens_per_step = args.batch * args.seq * world
    ours = tokens_per_step / statistics.median(times["ours"])
    plain = tokens_per_step / statistics.median(times["plain"])
    if rank == 0:
        print(
            json.dumps(
                {
                    "bench": "trainer",
                    "flavor": args.flavor,
                    "nproc": world,
                    "batch_per_rank": args.batch,
                    "seq": args.seq,
                    "tokens_per_s": round(ours, 1),
                    "plain_tokens_per_s": round(plain, 1),
                    "ratio": round(ours / plain, 3),
                }
            ),
            flush=True,
        )
    platform.shutdown_distributed()


if __name__ == "__main__":
    main()
    platform.exit_process(0)
