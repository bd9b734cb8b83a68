"""What a user with one GPU runs first: the CUDA path end to end on the tiny model, one JSON line.

    scripts/gpu_smoke.sh          (assets from scripts/setup.sh; not run in CI: CI has no GPU)

Trainer side (needs torch with CUDA and torchtitan): the platform choices (device, the
cpu:gloo,cuda:nccl process group, causal SDPA), host figures reduced through gloo, a
PolicyTrainer on the GPU taking 3 optimizer steps whose pre-update logprobs equal a separate
scoring pass, and weight sync into a bf16 copy of the model, checked bitwise. With vLLM's CUDA
build installed it then runs the colocated loop for 3 steps, batch-invariant mode on, and adds
that run's figures; without it, `"loop": "skipped (no vllm)"`.
"""

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from torchtitan_rl import platform
from torchtitan_rl.config import ModelSection, ParallelismSection, TrainingSection
from torchtitan_rl.trainer.policy_trainer import PolicyTrainer
from torchtitan_rl.types import RolloutBatch
from torchtitan_rl.weight_sync import WeightSync

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "assets" / "tiny_qwen3")


def pg_loss(logprobs_BT, micro, scale):
    weighted_BT = micro.advantages_B[:, None] * logprobs_BT * micro.loss_mask_BT
    return -weighted_BT.sum() / scale.tokens, {}


def fixed_batch() -> RolloutBatch:
    g = torch.Generator().manual_seed(0)
    tokens_BT = torch.randint(3, 64, (8, 24), generator=g)
    mask_BT = torch.zeros(8, 24)
    mask_BT[:, 8:] = 1.0
    return RolloutBatch(
        tokens_BT=tokens_BT,
        loss_mask_BT=mask_BT,
        advantages_B=torch.linspace(-1, 1, 8),
        generator_logprobs_BT=torch.zeros(8, 24),
    )


def trainer_side() -> dict:
    figures: dict = {
        "device": str(platform.device()),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "backend": platform.dist_backend(),
        "torch": torch.__version__,
    }
    sums = torch.tensor([1.0, 2.0])
    platform.all_reduce_host(sums)  # a host tensor on the cpu:gloo,cuda:nccl group
    platform.all_reduce_host(sums, group=dist.new_group([0]))  # a subgroup inherits both
    figures["host_all_reduce"] = sums.tolist() == [1.0, 2.0]
    figures["all_gather_objects"] = platform.all_gather_objects({"rank": 0}) == [{"rank": 0}]

    trainer = PolicyTrainer(
        model=ModelSection(hf_checkpoint=TINY),
        training=TrainingSection(lr=1e-3, micro_batches=2, activation_checkpoint="full"),
        parallelism=ParallelismSection(),
    )
    batch = fixed_batch()
    before_BT, _ = trainer.logprobs(batch.tokens_BT)
    steps = []
    for _ in range(3):
        start = time.perf_counter()
        result = trainer.optimizer_step(batch, pg_loss)
        steps.append(time.perf_counter() - start)
        if len(steps) == 1:
            figures["step_logprobs_equal_scoring"] = bool(
                torch.allclose(result.logprobs_BT, before_BT, rtol=1e-5, atol=1e-5)
            )
            figures["logprobs_device"] = str(result.logprobs_BT.device)
    figures["losses_finite"] = bool(torch.isfinite(torch.tensor(result.metrics["loss"])))
    figures["train_step_s"] = round(min(steps), 4)

    # The generator's side of a weight sync, without vLLM: a plain bf16 copy of the model.
    with torch.device(platform.device()):
        copy = trainer.spec.model.build().to(torch.bfloat16)
    targets = {
        name: param for name, param in copy.named_parameters() if name in trainer.named_parameters()
    }
    sync = WeightSync(trainer.named_parameters(), targets, verify=True)
    start = time.perf_counter()
    written, _ = sync.copy()
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    figures["weight_sync_s"] = round(time.perf_counter() - start, 4)
    figures["weight_sync_bytes"] = written
    figures["weight_sync_bitwise"] = all(
        torch.equal(targets[name], param.full_tensor().to(torch.bfloat16))
        for name, param in trainer.named_parameters().items()
    )
    return figures


def loop_side() -> dict | str:
    if importlib.util.find_spec("vllm") is None:
        return "skipped (no vllm)"
    dump = REPO / "outputs" / "gpu_smoke"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "1",
        "-m",
        "torchtitan_rl.train",
        "--job.config_file",
        str(REPO / "run_configs" / "debug_cpu.toml"),
        "--job.dump_folder",
        str(dump),
        "--training.steps",
        "3",
        "--batch_invariant",
        "true",
        "--batch_invariant_on_mismatch",
        "warn",
        "--generator.gpu_memory_utilization",
        "0.3",
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        return {"returncode": done.returncode, "stderr": done.stderr[-2000:]}
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return {
        "steps": len(rows),
        "logprob_diff_max": max(r["logprob_diff/max"] for r in rows),
        "step_s": rows[-1]["time/step_s"],
        "reward_mean": rows[-1]["reward/mean"],
    }


def main() -> int:
    os.chdir(REPO)
    platform.patch_torchtitan()
    platform.init_distributed()
    result = {"bench": "gpu_smoke", **trainer_side()}
    dist.destroy_process_group()
    result["loop"] = loop_side()
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    platform.exit_process(main())
