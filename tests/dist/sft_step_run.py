"""Two SFTTrainers from the same weights take the first step of the same rows: in one
micro-batch per rank, and in micro-batches cut by a token budget (as many on every rank, though
the ranks' rows pack into different counts; each micro-batch one packed row). Rank 0 saves both steps' gradients and metrics.

    torchrun --nproc_per_node 2 tests/dist/sft_step_run.py OUT_DIR DATA.jsonl BUDGET
"""

import sys
from pathlib import Path

import torch
from helpers.batches import recorded_grads

from torchtitan_rl import platform
from torchtitan_rl.config import parse_args
from torchtitan_rl.sft import SFTTrainer
from torchtitan_rl.tasks.sft_data import sft_batch
from torchtitan_rl.trainer import packing

TINY = str(Path(__file__).resolve().parents[2] / "assets" / "tiny_qwen3")


def first_step(out: Path, data: str, budget: int, world: int) -> dict:
    config = parse_args(
        [
            *("--model.hf_checkpoint", TINY, "--task.name", "dataset"),
            *("--task.dataset_path", data, "--job.dump_folder", str(out)),
            *("--sft.batch_size", "16", "--sft.max_seq_len", "64"),
            *("--sft.micro_batch_tokens", str(budget), "--training.lr", "1e-2"),
            *("--training.max_grad_norm", "0"),
        ],
        world,
        entry="sft",
    )
    sft = SFTTrainer(config)
    rows = sft.rows(1)
    batch = sft_batch(rows)
    micro_batches = sft.trainer.micro_batches(batch)
    lengths = packing.needed(batch.loss_mask_BT)
    with recorded_grads(sft.trainer) as grads:
        metrics = sft.train_step(1)
    return {
        "grads": grads,
        "metrics": metrics,
        "packed": platform.all_gather_objects(
            len(packing.first_fit_decreasing(lengths, budget))
        ),
        "tokens": platform.all_gather_objects(
            [sum(packing.needed(m.loss_mask_BT)) for _, m in micro_batches]
        ),
    }


def main() -> None:
    out, data = Path(sys.argv[1]), sys.argv[2]
    budget = int(sys.argv[3])
    platform.patch_torchtitan()
    rank, world = platform.init_distributed()
    whole = first_step(out / "whole", data, 1024, world)
    cut = first_step(out / "cut", data, budget, world)
    if rank == 0:
        torch.save({"whole": whole, "cut": cut}, out / "result.pt")
    platform.shutdown_distributed()


if __name__ == "__main__":
    main()
    platform.exit_process(0)
