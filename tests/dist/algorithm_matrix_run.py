"""Every algorithm combination through the real colocated loop: one RLTrainer (one vLLM engine
per rank), its algorithm swapped and its weights reset between combinations, three RL steps each.

    torchrun --nproc_per_node 2 tests/dist/algorithm_matrix_run.py OUT_DIR

Rank 0 writes OUT_DIR/matrix.json: per combination its settings, the metrics of its last step,
the clip fraction of each step and whether every rank's weights moved; tests/test_algorithm_matrix.py asserts on it.
"""

import contextlib
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from torchtitan_rl import platform
from torchtitan_rl.algorithms.advantages import build_advantage
from torchtitan_rl.algorithms.losses import build_loss
from torchtitan_rl.config import AlgorithmSection, DistillSection, parse_args
from torchtitan_rl.learner import build_teacher
from torchtitan_rl.placements.colocated import RLTrainer
from torchtitan_rl.weight_sync.base import SyncStats

REPO = Path(__file__).resolve().parents[2]
TEACHER = str(REPO / "assets" / "tiny_qwen3")
STEPS_EACH = 3


def combinations() -> list[dict]:
    """advantage x loss x mini_batches (1, 2) x KL (off, k3), then the off-policy corrections,
    KL in the reward, two epochs, and the overlong reward shapings."""
    rows = [
        {"advantage": a, "loss": loss, "mini_batches": m, "kl_beta": kl}
        for a, loss, m, kl in itertools.product(
            ("grpo", "dr_grpo", "rloo"), ("grpo", "dapo", "gspo"), (1, 2), (0.0, 0.05)
        )
    ]
    # The corrections run against a generator that lags (Lagging) in their default bands:
    # two updates at lr 5e-3 put ratios far outside them (measured: 4.4 to 11 at step 3).
    for mode, level, low, high in (
        ("tis", "token", 0.0, 2.0),
        ("tis", "sequence", 0.0, 2.0),
        ("mis", "token", 0.5, 2.0),
        ("mis", "sequence", 0.5, 2.0),
    ):
        rows.append(
            {
                "mini_batches": 2,
                "offpolicy_correction": mode,
                "offpolicy_level": level,
                "offpolicy_ratio_min": low,
                "offpolicy_ratio_max": high,
            }
        )
    rows.append({"kl_beta": 0.05, "kl_estimator": "k1", "kl_in_reward": True, "mini_batches": 2})
    rows.append({"mini_batches": 2, "epochs": 2, "clip_ratio_c": 3.0})
    # max_tokens = 2: a buffer of 1 takes 1 from every 2-token sample.
    rows += [{"overlong": "zero_reward"}, {"overlong": "soft_penalty", "overlong_buffer": 1}]
    # A distill teacher (the starting checkpoint) beside the reward, in each mode (Distilling).
    rows += [{"distill_mode": "advantage"}, {"distill_mode": "loss"}]
    return rows


class Lagging:
    """The generator keeps the starting weights for a combination's steps: the trainer's sync
    sends nothing, so each step's behaviour logprobs come from a policy 0, 1, then 2 updates
    older than the trainer's (what a stale generator gives, without a second placement)."""

    def __init__(self, rl: RLTrainer):
        self.rl, self.real = rl, rl.transport.send

    def send(self, version: int) -> SyncStats:
        return SyncStats(bytes=0, seconds=0.0, gb_per_s=0.0, peak_extra_bytes=0, version=0)

    def __enter__(self):
        self.rl.transport.send = self.send

    def __exit__(self, *exc):
        self.rl.transport.send = self.real


class Distilling:
    """The run learns from both its reward and a teacher, the starting checkpoint (built once:
    `teacher`), in `mode` (advantage or loss), for a combination's steps."""

    def __init__(self, rl: RLTrainer, teacher, mode: str):
        self.rl, self.teacher, self.mode = rl, teacher, mode

    def __enter__(self):
        config = self.rl.learner.config
        config.distill = DistillSection(teacher_checkpoint=TEACHER, mode=self.mode)
        config.task.learn_from = "both"
        self.rl.learner.teacher = self.teacher
        self.rl.learner.loss = build_loss(config.algorithm, 2, distill=config.distill)

    def __exit__(self, *exc):
        config = self.rl.learner.config
        config.distill, config.task.learn_from = DistillSection(), "reward"
        self.rl.learner.teacher = None


def weights(rl: RLTrainer) -> torch.Tensor:
    params = rl.learner.trainer.named_parameters().values()
    return torch.cat([p.detach().to_local().flatten() for p in params])


def restart(rl: RLTrainer, start: dict[str, torch.Tensor]) -> None:
    """Every combination starts from the checkpoint, with fresh AdamW state, on both sides."""
    with torch.no_grad():
        for name, param in rl.learner.trainer.named_parameters().items():
            param.to_local().copy_(start[name])
    for optimizer in rl.learner.trainer.optimizers.optimizers:
        optimizer.state.clear()
    rl.transport.send(version=0)


def main() -> None:
    out = Path(sys.argv[1])
    platform.patch_torchtitan()
    rank, world_size = platform.init_distributed()
    config = parse_args(
        [
            "--job.config_file",
            str(REPO / "run_configs" / "debug_cpu.toml"),
            "--model.hf_checkpoint",
            str(REPO / "assets" / "tiny_qwen3"),
            "--training.steps",
            "1000",
            "--training.prompts_per_step",
            "16",
            "--training.lr",
            "5e-3",
            "--algorithm.kl_beta",
            "0.05",  # builds the reference; combinations set their own
            "--metrics.rollout_log_interval",
            "0",
            "--job.dump_folder",
            str(out),
        ],
        world_size,
    )
    rl = RLTrainer(config, hooks=None)
    config.distill.teacher_checkpoint = TEACHER
    teacher = build_teacher(config)
    config.distill = DistillSection()
    start = {n: p.detach().to_local().clone() for n, p in rl.learner.trainer.named_parameters().items()}
    results, step = [], 0
    for combination in combinations():
        training = {k: combination.pop(k) for k in ("mini_batches", "epochs") if k in combination}
        distill_mode = combination.pop("distill_mode", None)
        config.training.mini_batches = training.get("mini_batches", 1)
        config.training.epochs = training.get("epochs", 1)
        algorithm = AlgorithmSection(**combination)
        algorithm.resolve(config.generator.sampling.max_tokens)
        algorithm.validate(config.generator.sampling.max_tokens)
        config.algorithm = algorithm
        rl.learner.loss = build_loss(algorithm, max_tokens=config.generator.sampling.max_tokens)
        rl.learner.advantage = build_advantage(algorithm.advantage)
        restart(rl, start)
        before = weights(rl)
        clip_fractions, corrections = [], []
        lagging = "offpolicy_correction" in combination
        context = contextlib.nullcontext()
        if lagging:
            context = Lagging(rl)
        elif distill_mode:
            context = Distilling(rl, teacher, distill_mode)
        with context:
            for _ in range(STEPS_EACH):
                step += 1
                metrics = rl.train_step(step)
                clip_fractions.append(metrics["clip_fraction"])
                corrections.append({k: v for k, v in metrics.items() if "offpolicy/" in k})
        moved = torch.tensor([float(not torch.equal(before, weights(rl)))])
        dist.all_reduce(moved, op=dist.ReduceOp.MIN)
        results.append(
            {
                "combination": combination
                | training
                | ({"distill_mode": distill_mode} if distill_mode else {}),
                "metrics": metrics,
                "clip_fractions": clip_fractions,
                "offpolicy_steps": corrections,
                "moved": bool(moved),
            }
        )
    if rank == 0:
        (out / "matrix.json").write_text(json.dumps(results, indent=1))
    platform.shutdown_distributed()


if __name__ == "__main__":
    main()
    platform.exit_process(0)
