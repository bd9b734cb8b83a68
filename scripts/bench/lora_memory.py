"""Peak memory per rank of the policy trainer with LoRA against full training, at a real shape.

    .venv/bin/python scripts/bench/lora_memory.py --flavor 0.6B [--steps 1 --seq 64 --dtype float32]

For each mode (full, then LoRA rank 8 on every attention and MLP linear) a 2-rank torchrun
child builds PolicyTrainer for the Qwen3 flavor (torchtitan's random init; 0.6B has the real
151,936-token vocabulary), FSDP over both ranks, `--dtype` compute (fp32 master weights; bf16
GEMMs are slow on this CPU), full activation checkpointing, and takes `--steps` (the first
allocates the optimizer state) policy-gradient steps on one sequence of `--seq` tokens per
rank. One JSON line: per mode, each rank's peak RSS (ru_maxrss: the whole process, the host
side of a GPU run), the bytes per rank of parameters, gradients and optimizer state (counted
from the tensors), the trainable parameters, the median step time, and the bytes a weight sync
writes into a bf16 generator after a step; then LoRA / full ratios of peak RSS and sync bytes.
"""

import argparse
import json
import resource
import statistics
import sys
import time

import torch
from children import REPO, report, run_child
from torch.distributed.tensor import DTensor

from torchtitan_rl import platform
from torchtitan_rl.config import (
    LoRASection,
    ModelSection,
    ParallelismSection,
    TrainingSection,
)
from torchtitan_rl.trainer.lora import Merged
from torchtitan_rl.trainer.policy_trainer import PolicyTrainer
from torchtitan_rl.types import LossScale, RolloutBatch

TOKENIZER = str(REPO / "assets" / "tiny_qwen3")


def pg_loss(logprobs_BT: torch.Tensor, batch: RolloutBatch, scale: LossScale):
    weighted_BT = batch.advantages_B[:, None] * logprobs_BT * batch.loss_mask_BT
    return -weighted_BT.sum() / scale.tokens, {}


def local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def measure(flavor: str, lora: bool, steps: int, seq: int, dtype: str) -> None:
    """A child rank: build, train, report (rank 0) the figures of every rank."""
    platform.patch_torchtitan()
    rank, _ = platform.init_distributed()
    trainer = PolicyTrainer(
        model=ModelSection(flavor=flavor, tokenizer_path=TOKENIZER, dtype=dtype),
        training=TrainingSection(activation_checkpoint="full"),
        parallelism=ParallelismSection(),
        lora=LoRASection(enable=lora),
    )
    vocab = trainer.spec.model.vocab_size
    g = torch.Generator().manual_seed(rank)
    batch = RolloutBatch(
        tokens_BT=torch.randint(0, vocab, (1, seq), generator=g),
        loss_mask_BT=torch.ones(1, seq),
        advantages_B=torch.ones(1),
        generator_logprobs_BT=torch.zeros(1, seq),
    )
    params = trainer.named_parameters()
    trainable = [p for p in params.values() if p.requires_grad]
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        trainer.optimizer_step(batch, pg_loss)
        times.append(time.perf_counter() - start)
    optimizer_state = sum(
        local_bytes(value)
        for optimizer in trainer.optimizers.optimizers
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    )
    sync_bytes = sum(
        source.shape.numel() * 2  # a bf16 generator
        for source in trainer.sync_sources().values()
        if isinstance(source, Merged) or source.requires_grad
    )
    figures = {
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3),
        "param_gib": round(sum(local_bytes(p) for p in params.values()) / 2**30, 3),
        # fp32 gradients of what trains (freed by zero_grad after each step).
        "grad_gib": round(sum(local_bytes(p) for p in trainable) / 2**30, 3),
        "optimizer_gib": round(optimizer_state / 2**30, 3),
    }
    ranks = platform.all_gather_objects(figures)
    platform.shutdown_distributed()
    if rank == 0:
        report(
            {
                "ranks": ranks,
                "trainable_params": sum(p.numel() for p in trainable),
                "params": sum(p.numel() for p in params.values()),
                "step_s": round(statistics.median(times[1:] or times), 2),
                "sync_bytes_per_step": sync_bytes,
            }
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="0.6B", help="qwen3 flavor: tiny, debugmodel, 0.6B")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--seq", type=int, default=64, help="tokens per rank and step")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--child", choices=["full", "lora"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        measure(args.flavor, args.child == "lora", args.steps, args.seq, args.dtype)
        return 0
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    modes = {}
    for mode in ("full", "lora"):
        command = [*torchrun, "--nproc_per_node", "2", __file__, "--child", mode]
        command += ["--flavor", args.flavor, "--steps", str(args.steps), "--seq", str(args.seq)]
        command += ["--dtype", args.dtype]
        modes[mode] = run_child(command)
    full, lora = modes["full"], modes["lora"]

    def peak(mode: dict) -> float:
        return max(rank["peak_rss_gib"] for rank in mode["ranks"])

    result = {
        "bench": "lora_memory",
        "flavor": args.flavor,
        "seq": args.seq,
        "dtype": args.dtype,
        **modes,
        "peak_rss_ratio": round(peak(lora) / peak(full), 3),
        "sync_bytes_ratio": round(lora["sync_bytes_per_step"] / full["sync_bytes_per_step"], 3),
    }
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
