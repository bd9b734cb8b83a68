"""The peer of scripts/bench/e2e.py: TRL's GRPOTrainer on the same run, one JSON line.

    .venv/bin/python scripts/bench/trl_peer.py --job.config_file run_configs/debug_cpu.toml \
        --training.steps 20

Same HF checkpoint, task prompts (in step order), rewards, prompts per step (P), group size
(G), max_tokens, temperature, lr and seed as our run of the same flags; TRL 1.16 generates with
HF `generate` (no vLLM), has no reference model (beta = 0, as ours without a KL), and uses
the loss_type matching algorithm.aggregation. One process with as many threads as our ranks
have together (`--threads`, default 2): the same cores. Prints the median step time over
steps 2.. (step 1 warms up) and the mean completion length.
"""

import json
import statistics
import sys
import tempfile
import time

TRL_LOSS_TYPE = {
    "token_mean": "dapo",
    "seq_mean_token_mean": "grpo",
    "seq_mean_token_sum": "luspo",
    "constant": "dr_grpo",
}


def main(argv: list[str]) -> int:
    threads = 2
    if argv[:1] == ["--threads"]:
        threads, argv = int(argv[1]), argv[2:]
    import torch

    torch.set_num_threads(threads)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from torchtitan_rl.config import parse_args
    from torchtitan_rl.tasks import build_task
    from torchtitan_rl.types import Prompt

    config = parse_args(argv, prog="scripts/bench/trl_peer.py")
    sampling, training = config.generator.sampling, config.training
    task = build_task(config.task, seed=config.job.seed)
    rows = [
        {"prompt": p.text, "answer": p.answer}
        for step in range(1, training.steps + 1)
        for p in task.prompts(step, training.prompts_per_step)
    ]

    def reward(prompts, completions, answer, **_) -> list[float]:
        return [
            task.reward(Prompt(text=p, answer=a), c)
            for p, c, a in zip(prompts, completions, answer, strict=True)
        ]

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.times, self.start = [], 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self.start)

    checkpoint = config.model.hf_checkpoint
    tokenizer = AutoTokenizer.from_pretrained(config.model.tokenizer_dir)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    timer = StepTimes()
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=training.prompts_per_step * sampling.n,
            num_generations=sampling.n,
            gradient_accumulation_steps=1,
            steps_per_generation=1,
            max_completion_length=sampling.max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            learning_rate=training.lr,
            lr_scheduler_type="constant",
            max_grad_norm=training.max_grad_norm or None,
            beta=0.0,
            epsilon=config.algorithm.clip_eps_low,
            epsilon_high=config.algorithm.clip_eps_high,
            loss_type=TRL_LOSS_TYPE[config.algorithm.aggregation],
            max_steps=training.steps,
            seed=config.job.seed,
            shuffle_dataset=False,
            use_cpu=True,
            bf16=False,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            disable_tqdm=True,
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=reward,
            args=args,
            train_dataset=Dataset.from_list(rows),
            processing_class=tokenizer,
            callbacks=[timer],
        )
        trainer.train()
    lengths = [
        row["completions/mean_length"]
        for row in trainer.state.log_history
        if "completions/mean_length" in row
    ]
    longest = [
        row["completions/max_length"]
        for row in trainer.state.log_history
        if "completions/max_length" in row
    ]
    timed = timer.times[1:] or timer.times
    print(
        json.dumps(
            {
                "bench": "trl_peer",
                "step_s": round(statistics.median(timed), 4),
                "response_length": round(statistics.mean(lengths), 2) if lengths else None,
                "response_length_max": max(longest) if longest else None,
                "final_reward": trainer.state.log_history[-2].get("reward"),
                "threads": threads,
                "steps": training.steps,
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
