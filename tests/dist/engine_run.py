"""One vLLM replica per rank next to FSDP PolicyTrainers, shared by the generator's and the
weight sync's checks (one engine start per rank for both).

    torchrun --standalone --nproc_per_node 2 tests/dist/engine_run.py OUT_DIR qwen3 \
        generator,weight_sync
    python tests/dist/engine_run.py OUT_DIR qwen3 weight_sync llama3 generator   (a world of
        one; several models' engines one after the other)

Generator: each rank samples its own prompts (one short, one longer than a 128-token KV
block), then a trainer recomputes the logprobs of every sampled token; a greedy pass is
replayed through the trainer's argmax (these alone: "sampling"); stop ids, stop strings,
seeds, bad prompts. "qwen3@tp2": one engine over each 2 ranks (generator tensor parallel);
"qwen3_5@bf16": the engine in bf16.
Compiled ("compiled"): the run's engines compile their decoder (the default); an eager engine
of the same model samples the same batches, which must give the same tokens. Every engine's
compiled graphs are recorded and inspected for host reads (helpers/compiled_graphs.py).
"moe@tp2+plain": the engine on plain GEMMs (generator.cpu_packed_gemm = false), as a GPU runs.
Images ("images", a vision-language model): prompts with images sampled against the trainer,
then the trainer's tower moved and synced.

Weight sync: a second trainer takes one step, its weights are copied without the prefix-cache
reset (to show the stale KV a 150-token prompt keeps), then synced properly. LoRA sync
("lora_sync", last: it leaves the merged weights): a LoRA trainer's weights, then only its
adapted linears after a step.

Each rank saves {"generator": ..., "weight_sync": ...} (the checks asked for) to
OUT_DIR/{model}.rank{r}.pt for the tests.
"""

import gc
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from helpers import compiled_graphs
from helpers.launch import REPO
from torch.distributed.tensor import DTensor, distribute_tensor

from torchtitan_rl import platform
from torchtitan_rl.config import (
    GeneratorParallelismSection,
    GeneratorSection,
    LoRASection,
    ModelSection,
    ParallelismSection,
    TrainingSection,
)
from torchtitan_rl.generator.engine import LocalGenerator
from torchtitan_rl.generator.engine_memory import kv_block_bytes
from torchtitan_rl.trainer.lora import Merged
from torchtitan_rl.trainer.policy_trainer import PolicyTrainer
from torchtitan_rl.types import LossScale, RolloutBatch
from torchtitan_rl.weight_sync import LocalTransport, base

# Names beyond a family's tiny flavor.
MODELS = {
    "moe": ModelSection(
        name="qwen3", flavor="tiny_moe", hf_checkpoint=str(REPO / "assets" / "tiny_moe_qwen3")
    ),
    "qwen3_5_moe": ModelSection(
        name="qwen3_5",
        flavor="tiny_moe",
        hf_checkpoint=str(REPO / "assets" / "tiny_moe_qwen3_5"),
    ),
    # The vision-language flavor, its tower trained (so that weight sync writes it).
    "muse_glimmer_vl": ModelSection(
        name="muse_glimmer",
        flavor="tiny_vl",
        hf_checkpoint=str(REPO / "assets" / "tiny_vl_muse_glimmer"),
        freeze_vision=False,
    ),
}
TEMPERATURE = 0.7  # the generator checks'
SYNC_TEMPERATURE = 0.8  # the weight sync checks'


def whole(t: torch.Tensor) -> torch.Tensor:
    """A TP generator's parameter gathered whole (a plain one as is)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def local(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of a parameter."""
    return t.to_local() if isinstance(t, DTensor) else t


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
        logits_BTV = trainer.model(tokens_BT, positions=positions_BT)
    argmax_T = logits_BTV[0, len(prompt) - 1 : -1].argmax(-1)
    return logprobs_BT[0, len(prompt) :], argmax_T


def sampling_checks(model: ModelSection, generator: LocalGenerator, rank: int, world: int) -> dict:
    """Sampled and greedy tokens against the trainer's recomputation; names and shapes."""
    trainer = PolicyTrainer(
        model=model,
        training=TrainingSection(),
        parallelism=ParallelismSection(),
        temperature=TEMPERATURE,
    )
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
    return {
        "world": world,
        "prompts": prompts,
        "sampled": [[s.token_ids for s in group] for group in sampled.samples],
        "sampled_logprobs": [[s.logprobs for s in group] for group in sampled.samples],
        "finish_reasons": [s.finish_reason for group in sampled.samples for s in group],
        "logprob_diffs": diffs,
        "lengths": lengths,
        "greedy_match": greedy_match,
        "generator_params": {k: tuple(v.shape) for k, v in generator.weights().items()},
        "trainer_params": {k: tuple(v.shape) for k, v in trainer.named_parameters().items()},
    }


def generator_checks(model: ModelSection, generator: LocalGenerator, rank: int, world: int) -> dict:
    """`sampling_checks`, then what does not depend on the engine's layout: bad prompts,
    seeds, stop ids and stop strings."""
    result = sampling_checks(model, generator, rank, world)
    prompts = result["prompts"]
    errors = {}
    for name, bad in {"too_long": [[5] * 256], "empty": [[]]}.items():
        try:
            generator.generate(bad)
        except ValueError as e:
            errors[name] = str(e)

    generator.reset_prefix_cache()
    again = generator.generate(prompts[:1], n=3, temperature=TEMPERATURE, max_tokens=12, seed=7)
    # The random tiny model emits each of its 68 ids at about the same rate: over 128 samples
    # of 24 tokens both stop ids of generation_config.json come up.
    stopping = generator.generate(prompts, n=64, temperature=1.5, max_tokens=24, seed=11)
    # A stop string (generator.sampling.stop) ends a completion too; the id "5" encodes to.
    generator.config.sampling.stop = ["5"]
    five = generator.generate(prompts, n=32, temperature=1.5, max_tokens=24, seed=12)
    generator.config.sampling.stop = []

    return {
        **result,
        "errors": errors,
        "seeded_repeat": [s.token_ids for s in again.samples[0]],
        "stop_token_ids": generator.stop_token_ids,
        "stopping": [(s.token_ids, s.finish_reason) for g in stopping.samples for s in g],
        "five_id": generator.engine.get_tokenizer().convert_tokens_to_ids("5"),
        "stopped_at_five": [(s.token_ids, s.finish_reason) for g in five.samples for s in g],
        "torch_distributed_usable": dist.is_initialized() and dist.get_world_size() == world,
    }


def compiled_checks(model: ModelSection, generator: LocalGenerator, rank: int, world: int) -> dict:
    """The compiled engine (this run's: vLLM compiles the decoder unless enforce_eager) against
    an eager engine of the same model, on batches that mix prefills, decodes and prefix-cache
    hits (a 150-token prompt, then one sharing its first 128-token block, while samples
    decode): sampled tokens for the same seeds, greedy tokens, their logprobs, and an MoE's
    captured routing. And how many graphs Dynamo has made in the process so far. The
    eager engine is given the compiled one's weights (which weight sync's checks may have
    updated in place), copied in place as a weight sync does."""
    from torch._dynamo.utils import counters

    prompts = prompts_for(rank)
    prompts.append(prompts[1][:128] + prompts[0])  # the long prompt's first block, cached

    def run(engine: LocalGenerator) -> dict:
        engine.reset_prefix_cache()
        sampled = engine.generate(prompts, n=3, temperature=TEMPERATURE, max_tokens=12, seed=7)
        greedy = engine.generate(prompts, n=1, temperature=0.0, max_tokens=12)
        samples = [s for c in (sampled, greedy) for group in c.samples for s in group]
        return {
            "tokens": [s.token_ids for s in samples],
            "logprobs": [s.logprobs for s in samples],
            "routing": [s.routed_experts for s in samples],
        }

    compiled = run(generator)
    graphs = dict(counters["stats"])
    eager = LocalGenerator(
        generator=GeneratorSection(max_model_len=256, enforce_eager=True), model=model, seed=rank
    )
    with torch.no_grad():
        theirs = eager.weights()
        for name, tensor in generator.weights().items():
            theirs[name].copy_(tensor)
    eager.refresh_after_weight_update()
    reference = run(eager)
    eager.close()
    return {
        "compiled": compiled,
        "eager": reference,
        "decoder_compiled": generator.compiled,
        "dynamo_graphs": graphs.get("unique_graphs", 0),
    }


def images_checks(model: ModelSection, generator: LocalGenerator, rank: int, world: int) -> dict:
    """A vision-language engine: prompts with images (two of different shapes, one, none),
    each sampled token's logprob against the trainer's with the prompt's images; then the
    trainer's tower moved (noise on its vision_* weights) and synced into the generator,
    verified: every weight the trainer's, and the samples' logprobs the moved trainer's. The
    share of its tower's weights the generator holds on this rank."""
    from helpers.vision_engine import prompt

    trainer = PolicyTrainer(
        model=model,
        training=TrainingSection(),
        parallelism=ParallelismSection(),
        temperature=TEMPERATURE,
    )
    transport = LocalTransport(trainer, generator, bucket_mb=0.1, verify=True)
    prompts = [prompt(((56, 84), (28, 28)), 0), prompt(((84, 56),), 1), ([3, 10, 11, 4, 3], None)]

    def sample():
        return generator.generate(
            [ids for ids, _ in prompts],
            n=2,
            temperature=TEMPERATURE,
            max_tokens=8,
            seed=7,
            images=[images for _, images in prompts],
        )

    def trainer_side(completions) -> list[torch.Tensor]:
        """The trainer's logprob of every sampled token, sample by sample."""
        recomputed = []
        for (ids, images), group in zip(prompts, completions.samples, strict=True):
            for sample in group:
                tokens_BT = torch.tensor([ids + sample.token_ids])
                logprobs_BT, _ = trainer.logprobs(tokens_BT, images_B=(images,))
                recomputed.append(logprobs_BT[0, len(ids) :])
        return recomputed

    def diff(completions) -> float:
        reported = [torch.tensor(s.logprobs) for group in completions.samples for s in group]
        pairs = zip(trainer_side(completions), reported, strict=True)
        return max(float((a - b).abs().max()) for a, b in pairs)

    before = sample()
    diff_before = diff(before)
    tower = {n: p for n, p in trainer.named_parameters().items() if n.startswith("vision_")}
    noise = torch.Generator().manual_seed(0)
    old = trainer_side(before)
    with torch.no_grad():
        for param in tower.values():
            whole_param = param.full_tensor()
            delta = torch.randn(whole_param.shape, generator=noise) * whole_param.std() / 2
            param.add_(distribute_tensor(delta, param.device_mesh, param.placements))
    moved = max(float((a - b).abs().max()) for a, b in zip(trainer_side(before), old, strict=True))
    transport.send(version=1)
    weights = generator.weights()
    mismatched = [
        name
        for name, param in trainer.named_parameters().items()
        if not torch.equal(whole(weights[name]), param.full_tensor())
    ]
    return {
        "diff_before": diff_before,
        "tower_moves": moved,
        "diff_after": diff(sample()),
        "mismatched_after_sync": mismatched,
        "tower_weights": len(tower),
        "tower_share": sum(local(weights[n]).numel() for n in tower)
        / sum(weights[n].numel() for n in tower),
        "tower_sharded": [n for n in tower if local(weights[n]).numel() < weights[n].numel()],
        "sampled": [s.token_ids for group in before.samples for s in group],
    }


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


def step_on(trainer: PolicyTrainer, prompt: list[int], completions) -> None:
    """One real optimizer step on a batch of 4 of the generator's own samples of `prompt`."""
    tokens = [prompt[-20:] + s.token_ids for s in completions.samples[0]]
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
    trainer.optimizer_step(batch, pg_loss)


def lora_sync_checks(model: ModelSection, generator: LocalGenerator, rank: int, world: int) -> dict:
    """A LoRA policy (FSDP) into the generator (TP: each rank writes its shard): every weight
    first, then after a step only the merged adapted linears, each copy verified against the
    merged whole tensor; then the generator's weights and samples are the merged policy's."""
    trainer = PolicyTrainer(
        model=model,
        training=TrainingSection(lr=2e-2, max_grad_norm=0.0),
        parallelism=ParallelismSection(),
        temperature=SYNC_TEMPERATURE,
        lora=LoRASection(enable=True, rank=4, alpha=8.0),
    )
    transport = LocalTransport(trainer, generator, bucket_mb=0.1, verify=True)
    first = transport.send(version=1)
    prompt = torch.randint(3, 64, (30,), generator=torch.Generator().manual_seed(rank)).tolist()

    def sample():
        return generator.generate(
            [prompt], n=4, temperature=SYNC_TEMPERATURE, max_tokens=10, seed=5
        )

    step_on(trainer, prompt, sample())
    second = transport.send(version=2)
    sources = trainer.sync_sources()
    targets = generator.weights()
    merged = [name for name, source in sources.items() if isinstance(source, Merged)]
    mismatched = [
        name
        for name, source in sources.items()
        if not torch.equal(whole(targets[name]), base.whole(source, torch.float32))
    ]
    return {
        "first_bytes": first.bytes,
        "second_bytes": second.bytes,
        "all_bytes": sum(t.numel() * t.element_size() for t in targets.values()),
        "merged_bytes": sum(targets[n].numel() * targets[n].element_size() for n in merged),
        "num_merged": len(merged),
        "mismatched": mismatched,
        "diff": max_logprob_diff(trainer, prompt, sample()),
        "version": generator.policy_version,
    }


def weight_sync_checks(
    model: ModelSection, generator: LocalGenerator, rank: int, world: int
) -> dict:
    trainer = PolicyTrainer(
        model=model,
        training=TrainingSection(lr=2e-2, max_grad_norm=0.0),
        parallelism=ParallelismSection(),
        temperature=SYNC_TEMPERATURE,
    )
    transport = LocalTransport(trainer, generator, bucket_mb=0.1, verify=True)
    sync = transport.copier

    g = torch.Generator().manual_seed(rank)
    long_prompt = torch.randint(3, 64, (150,), generator=g).tolist()
    short_prompt = torch.randint(3, 64, (7,), generator=g).tolist()

    def sample(prompt):
        return generator.generate(
            [prompt], n=4, temperature=SYNC_TEMPERATURE, max_tokens=10, seed=3
        )

    before = sample(long_prompt)  # fills the prefix cache with old-weight KV
    diff_before_step = max_logprob_diff(trainer, long_prompt, before)

    step_on(trainer, long_prompt, before)
    stale_params = sum(
        not torch.equal(whole(generator.weights()[k]), p.full_tensor())
        for k, p in trainer.named_parameters().items()
    )

    # Copy without resetting the prefix cache: the cached block still holds old-weight KV.
    sync.copy()
    generator.repack_weights()
    diff_stale_cache = max_logprob_diff(trainer, long_prompt, sample(long_prompt))

    stats = transport.send(version=7)
    mismatched = [
        name
        for name, param in trainer.named_parameters().items()
        if not torch.equal(whole(generator.weights()[name]), param.full_tensor())
    ]
    diff_long = max_logprob_diff(trainer, long_prompt, sample(long_prompt))
    diff_short = max_logprob_diff(trainer, short_prompt, sample(short_prompt))
    return {
        "world": world,
        "model": model.name,
        "generator_bytes": sum(
            p.numel() * p.element_size() for p in map(local, generator.weights().values())
        ),
        "diff_before_step": diff_before_step,
        "stale_params_before_sync": stale_params,
        "diff_stale_cache": diff_stale_cache,
        "diff_long": diff_long,
        "diff_short": diff_short,
        "mismatched_after_sync": mismatched,
        "num_params": len(trainer.named_parameters()),
        "stats": stats,
        "num_buckets": len(sync.buckets),
        "version": generator.policy_version,
    }


def main() -> None:
    out, pairs = Path(sys.argv[1]), sys.argv[2:]
    platform.patch_torchtitan()
    rank, world = platform.init_distributed()
    run = {
        "generator": generator_checks,
        "sampling": sampling_checks,
        "weight_sync": weight_sync_checks,
        "lora_sync": lora_sync_checks,
        "compiled": compiled_checks,
        "images": images_checks,
    }
    # One engine at a time: each model's checks, then its engine is freed before the next.
    for name, checks in zip(pairs[::2], pairs[1::2], strict=True):
        # "qwen3@tp2": one engine over each 2 consecutive ranks, which share its prompts and
        # seeds (the group's first rank's).
        # "moe@ep2": the same, the experts whole over the 2 ranks (expert parallel).
        # "qwen3_5@bf16": the engine in bf16 (Qwen3.5's Gated DeltaNet layers then run
        # vLLM's CPU kernels); the trainer recomputes in fp32.
        # "qwen3_5@tp2+bf16": both. "+plain": plain GEMMs (generator.cpu_packed_gemm false).
        family, _, layout = name.partition("@")
        parts = layout.split("+")
        tp = next((int(p[2:]) for p in parts if p.startswith(("tp", "ep"))), 1)
        replica = rank // tp * tp
        model = MODELS.get(family) or ModelSection(
            name=family, flavor="tiny", hf_checkpoint=str(REPO / "assets" / f"tiny_{family}")
        )
        with compiled_graphs.recording() as graphs:
            generator = LocalGenerator(
                generator=GeneratorSection(
                    max_model_len=256,
                    parallelism=GeneratorParallelismSection(
                        tensor_parallel_degree=tp,
                        expert_parallel=any(p.startswith("ep") for p in parts),
                    ),
                    dtype="bfloat16" if "bf16" in parts else "float32",
                    cpu_packed_gemm="plain" not in parts,
                ),
                model=model,
                seed=replica,
            )
            results = {c: run[c](model, generator, replica, world) for c in checks.split(",")}
        # What vLLM compiled for this engine (an eager engine: nothing), for host reads.
        results["graphs"] = compiled_graphs.summary(graphs)
        results["local_numel"] = sum(local(t).numel() for t in generator.weights().values())
        results["engine_compiled"] = generator.compiled
        # Tensor parallel on plain local shards (generator/tensor_parallel.py): the model's
        # parameters are plain, weight sync sees them as DTensors.
        results["plain_parameters"] = not any(
            isinstance(p, DTensor) for p in generator.model().parameters()
        )
        # The KV cache vLLM allocated, and the block size the CPU cap reckons with.
        results["kv_cache_bytes"] = generator.kv_cache_bytes()
        results["kv_block_bytes"] = kv_block_bytes(model, generator.config)
        # Qwen3.5: what each Gated DeltaNet layer runs on (vLLM's kernels; stacked projections).
        layers = [m for m in generator.model().modules() if hasattr(m, "PROJECTIONS")]
        results["gated_delta"] = [
            {"vllm_kernels": m.paged.vllm_kernels, "stacked": m.stacked is not None} for m in layers
        ]
        torch.save(results, out / f"{name}.rank{rank}.pt")
        generator.close()  # its groups: the next engine builds its own
        del generator
        gc.collect()
    platform.shutdown_distributed()


if __name__ == "__main__":
    main()
    platform.exit_process(0)  # also skips vLLM's slow teardown
