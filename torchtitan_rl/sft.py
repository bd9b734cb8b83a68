"""SFT warm start: the RL run's PolicyTrainer with a token cross-entropy step on demonstrations.

    torchrun --nproc_per_node 2 -m torchtitan_rl.sft \
        --job.config_file run_configs/sft_arith_cpu.toml

The same JobConfig as an RL run (an SFT run refuses RL-only values), the same dataset reader
and chat rendering (tasks/sft_data.py), the same checkpoints, metrics and HF export: the export
at {job.dump_folder}/hf is what an RL config loads with model.hf_checkpoint. A step: this
data-parallel rank's sft.batch_size / ranks rows of the step (the dataset read in seeded,
shuffled epochs, so resume is exact) -> micro-batches of at most sft.micro_batch_tokens
tokens -> one optimizer step on the mean NLL of every rank's response tokens. With
eval.dataset_path: the held-out NLL at the start, every eval.interval steps and at the end,
and the trainer's greedy completions of eval.log_samples held-out prompts in eval.jsonl.
Shapes: B rows, T tokens.
"""

import dataclasses
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist

from torchtitan_rl import launch, platform, watchdog
from torchtitan_rl.checkpoint import Checkpointer, TrainState, run_facts
from torchtitan_rl.config import JobConfig
from torchtitan_rl.evaluation import eval_due
from torchtitan_rl.hf_export import export_policy
from torchtitan_rl.metrics import run_metrics
from torchtitan_rl.tasks.dataset import epoch_order
from torchtitan_rl.tasks.sft_data import Example, SFTData, open_sft_data, sft_batch
from torchtitan_rl.trainer.policy_trainer import NonFiniteError, PolicyTrainer
from torchtitan_rl.types import LossScale, RolloutBatch


def cross_entropy(
    logprobs_BT: torch.Tensor, batch: RolloutBatch, scale: LossScale
) -> tuple[torch.Tensor, dict[str, float]]:
    """This micro-batch's share of the step's mean NLL over every response token of the step."""
    nll = -(logprobs_BT * batch.loss_mask_BT).sum()
    return nll / max(scale.tokens, 1), {}


class SFTTrainer:
    """Owns the policy trainer, the demonstrations, checkpoints and metrics of an SFT run."""

    def __init__(self, config: JobConfig, data: SFTData | None = None):
        """`data`: the demonstrations, opened (the launcher opens them once); None opens them."""
        self.config = config
        self.rank, world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(config.job.seed)
        facts = run_facts(config) | {"prompts_per_step": config.sft.batch_size}
        self.checkpointer = Checkpointer(config.checkpoint, config.job.dump_folder, facts)
        resume_path = self.checkpointer.find()
        # Before any model: a bad row fails in seconds, naming file:row.
        self.data: SFTData = data or open_sft_data(config)
        self.trainer = PolicyTrainer(
            model=config.model,
            training=config.training,
            parallelism=config.parallelism,
            seed=config.job.seed,
            dump_folder=config.job.dump_folder,
            lora=config.lora,
            micro_batch_tokens=config.sft.micro_batch_tokens,
        )
        # torchtitan puts TP innermost: the ranks of a TP group share their rows.
        self.tp = config.parallelism.tp
        self.data_rank, self.data_ranks = self.rank // self.tp, world // self.tp
        self.state = TrainState()
        self.checkpointer.attach(self.trainer, self.state)
        self.start_step = self.checkpointer.load(resume_path) if resume_path else 0
        self.metrics = run_metrics(config, enabled=self.rank == 0, resume_step=self.start_step)

    def train(self) -> None:
        steps = self.config.training.steps
        evaluating = bool(self.data.held_out)
        if evaluating and self.start_step == 0 and eval_due(self.config.eval, 0, steps):
            self.evaluate(0)
        for step in range(self.start_step + 1, steps + 1):
            watchdog.mark(step, "train")
            self.train_step(step)
            if evaluating and eval_due(self.config.eval, step, steps):
                watchdog.mark(step, "eval")
                self.evaluate(step)
            self.state.step = step
            if watchdog.end_step(self.checkpointer, step, last=step == steps, group=None):
                raise watchdog.Preempted(watchdog.preempted_line(self.checkpointer, step))
        watchdog.mark(steps, "end")
        self.checkpointer.close()
        if self.config.checkpoint.export_hf_at_end:
            hf = Path(self.config.job.dump_folder) / "hf"
            export_policy(self.trainer, self.config.model, hf)
        self.metrics.close()

    def train_step(self, step: int) -> dict[str, float]:
        start = time.perf_counter()
        rows = self.rows(step)
        result = self.trainer.optimizer_step(sft_batch(rows), cross_entropy, step=step)
        tokens = torch.tensor([float(sum(len(e) for e in rows))], dtype=torch.float64)
        platform.all_reduce_host(tokens)
        elapsed = time.perf_counter() - start
        epoch = step * self.config.sft.batch_size / len(self.data.examples)
        metrics = {
            **result.metrics,
            "epoch": epoch,
            "throughput/tokens_per_s": float(tokens[0]) / self.tp / elapsed,
            "time/step_s": elapsed,
        }
        self.metrics.log(step, metrics)
        return metrics

    def rows(self, step: int) -> list[Example]:
        """This data-parallel rank's contiguous share of the step's sft.batch_size rows."""
        batch_size = self.config.sft.batch_size
        per_rank = batch_size // self.data_ranks
        first = (step - 1) * batch_size + self.data_rank * per_rank
        examples = self.data.examples
        seed = self.config.job.seed
        return [
            examples[epoch_order(len(examples), i, seed)] for i in range(first, first + per_rank)
        ]

    @torch.no_grad()
    def evaluate(self, step: int) -> dict[str, float]:
        """The held-out NLL over every rank's shard, and greedy samples of the first
        eval.log_samples held-out rows; rank 0 logs eval/* and writes the samples."""
        began = time.perf_counter()
        held_out = self.data.held_out
        per_rank = math.ceil(len(held_out) / self.data_ranks)
        mine = held_out[self.data_rank * per_rank : (self.data_rank + 1) * per_rank]
        # A rank short of rows scores a copy of one with nothing trained in it: every rank
        # must run as many forwards.
        filler = dataclasses.replace(held_out[0], prompt_len=len(held_out[0]))
        mine = mine + [filler] * (per_rank - len(mine))
        batch = sft_batch(mine)
        logprobs_BT, _ = self.trainer.logprobs(
            batch.tokens_BT, batch.loss_mask_BT, images_B=batch.images_B
        )
        mask_BT = batch.loss_mask_BT.to(logprobs_BT.device)
        sums = torch.tensor([float(-(logprobs_BT * mask_BT).sum()), float(mask_BT.sum())])
        platform.all_reduce_host(sums)
        nll, tokens = (sums / self.tp).tolist()
        if not math.isfinite(nll):
            raise NonFiniteError(f"step {step}: the held-out loss is {nll}")
        samples = self.samples(held_out[: self.config.eval.log_samples])
        matches = sum(sample["exact_match"] for sample in samples)
        metrics = {
            "eval/loss": nll / tokens,
            "eval/tokens": tokens,
            "eval/samples_exact_match": matches / max(len(samples), 1),
            "time/eval_s": time.perf_counter() - began,
        }
        self.metrics.log_eval(step, metrics, samples)
        return metrics

    def samples(self, examples: list[Example]) -> list[dict]:
        """The trainer's greedy completions of `examples`' prompts (as long as the longest
        reference response, or eval.max_tokens), beside the references."""
        if not examples:
            return []
        max_tokens = self.config.eval.max_tokens or max(len(e) - e.prompt_len for e in examples)
        prompts = [e.tokens[: e.prompt_len] for e in examples]
        images = [e.images for e in examples]
        completions = self.trainer.greedy(prompts, max_tokens, self.data.stop_ids, images)
        renderer = self.data.renderer
        return [
            {
                "prompt": renderer.text(e.prompt),
                "completion": renderer.decode(ids),
                "reference": e.response,
                "exact_match": ids == e.tokens[e.prompt_len :],
                "token_ids": ids,
            }
            for e, ids in zip(examples, completions, strict=True)
        ]


SFT = launch.Program(
    entry="sft", open=open_sft_data, run=lambda config, data: SFTTrainer(config, data).train()
)


def main(argv: list[str] | None = None) -> int:
    return launch.main(SFT, argv)


if __name__ == "__main__":
    platform.exit_process(main())
