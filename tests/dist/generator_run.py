"""One vLLM replica per rank next to an FSDP PolicyTrainer: generate, then score with the trainer.

    torchrun --standalone --nproc_per_node 2 tests/dist/generator_run.py OUT_DIR [MODEL]
    python tests/dist/generator_run.py OUT_DIR llama3      (a world of one, no torchrun)

Each rank samples its own prompts (one short, one longer than a 128-token KV block), then the
trainer recomputes the logprobs of every sampled token; a greedy pass is replayed through the
trainer's argmax. Each rank saves what it measured to OUT_DIR/rank{r}.pt for the tests.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from torchtitan_rl import platform
from torchtitan_rl.config.job_config import (
    GeneratorSection,
    ModelSection,
    ParallelismSection,
    TrainingSection,
)
from torchtitan_rl.generator.engine import Generator
from torchtitan_rl.trainer.policy_trainer import PolicyTrainer

ASSETS = Path(__file__).resolve().parents[2] / "assets"
TEMPERATURE = 0.7


def prompts_for(rank: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(100 + rank)
    short = torch.randint(3, 64, (9,), generator=g).tolist()
    long = torch.randint(3, 64, (150,), generator=g).tolist()  # > one 128-token KV block
    return [short, long]


def trainer_logprobs(trainer: PolicyTrainer, prompt: list[int], tokens: list[int]):
    """Trainer logprobs of `tokens` after `prompt`, and its argmax prediction at each step."""
    tokens_BT = torch.tensor([prompt + tokens])
    logprobs_BT, _ = trainer.logprobs(tokens_BT)
    positions_BT = torch.arange(tokens_BT.shape[1])[None]
    with torch.no_grad():
        logits_BTV = trainer.model(tokens_BT, positions_BT, None)
    argmax_T = logits_BTV[0, len(prompt) - 1 : -1].argmax(-1)
    return logprobs_BT[0, len(prompt) :], argmax_T


def main() -> None:
    out = Path(sys.argv[1])
    name = sys.argv[2] if len(sys.argv) > 2 else "qwen3"
    platform.patch_torchtitan()
    rank, world = platform.init_distributed()
    model = ModelSection(name=name, hf_checkpoint=str(ASSETS / f"tiny_{name}"))
    trainer = PolicyTrainer(
        model=model,
        training=TrainingSection(),
        parallelism=ParallelismSection(),
        temperature=TEMPERATURE,
    )
    generator = Generator(generator=GeneratorSection(max_model_len=256), model=model, seed=rank)
    prompts = prompts_for(rank)

    sampled = generator.generate(prompts, n=3, temperature=TEMPERATURE, max_tokens=12, seed=7)
    diffs, lengths = [], []
    for prompt, group in zip(prompts, sampled.samples, strict=True):
        for sample in group:
            recomputed, _ = trainer_logprobs(trainer, prompt, sample.token_ids)
            reported = torch.tensor(sample.logprobs)
            diffs.append(float((recomputed - reported).abs().max()))
            lengths.append(len(sample.token_ids))

    # Greedy: vLLM reports log_softmax(logits) when temperature is 0 (no scaling).
    greedy = generator.generate(prompts, n=1, temperature=0.0, max_tokens=12)
    greedy_match = []
    for prompt, (sample,) in zip(prompts, greedy.samples, strict=True):
        _, argmax_T = trainer_logprobs(trainer, prompt, sample.token_ids)
        greedy_match.append(argmax_T.tolist() == sample.token_ids)

    errors = {}
    for name, bad in {"too_long": [[5] * 256], "empty": [[]]}.items():
        try:
            generator.generate(bad)
        except ValueError as e:
            errors[name] = str(e)

    generator_params = {k: tuple(v.shape) for k, v in generator.named_parameters().items()}
    trainer_params = {k: tuple(v.shape) for k, v in trainer.named_parameters().items()}
    generator.reset_prefix_cache()
    again = generator.generate(prompts[:1], n=3, temperature=TEMPERATURE, max_tokens=12, seed=7)
    # The random tiny model emits each of its 68 ids at about the same rate: over 128 samples
    # of 24 tokens both stop ids of generation_config.json come up.
    stopping = generator.generate(prompts, n=64, temperature=1.5, max_tokens=24, seed=11)
    # A stop string (generator.sampling.stop) ends a completion too; the id "5" encodes to.
    generator.config.sampling.stop = ["5"]
    five = generator.generate(prompts, n=32, temperature=1.5, max_tokens=24, seed=12)
    generator.config.sampling.stop = []

    torch.save(
        {
            "world": world,
            "prompts": prompts,
            "sampled": [[s.token_ids for s in group] for group in sampled.samples],
            "finish_reasons": [s.finish_reason for group in sampled.samples for s in group],
            "logprob_diffs": diffs,
            "lengths": lengths,
            "greedy_match": greedy_match,
            "errors": errors,
            "generator_params": generator_params,
            "trainer_params": trainer_params,
            "seeded_repeat": [s.token_ids for s in again.samples[0]],
            "stop_token_ids": generator.stop_token_ids,
            "stopping": [(s.token_ids, s.finish_reason) for g in stopping.samples for s in g],
            "five_id": generator.engine.get_tokenizer().convert_tokens_to_ids("5"),
            "stopped_at_five": [(s.token_ids, s.finish_reason) for g in five.samples for s in g],
            "torch_distributed_usable": dist.is_initialized() and dist.get_world_size() == world,
        },
        out / f"rank{rank}.pt",
    )
    platform.shutdown_distributed()


if __name__ == "__main__":
    main()
    platform.exit_process(0)  # also skips vLLM's slow teardown
