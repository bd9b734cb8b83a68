"""Benchmark PolicyTrainer.optimizer_step: against a plain torchtitan step (uniform or
long-tailed rows), or packed against padded micro-batches on a long-tailed mix of lengths.

    .venv/bin/torchrun --standalone --nproc_per_node 2 scripts/bench/trainer.py --flavor tiny
    .venv/bin/torchrun --standalone --nproc_per_node 2 scripts/bench/trainer.py --flavor tiny \
        --dtype bfloat16 --compile
    .venv/bin/torchrun --standalone --nproc_per_node 2 scripts/bench/trainer.py \
        --lengths longtail --compare plain --flavor debugmodel --sequences 8 --max_completion 512
    .venv/bin/torchrun --standalone --nproc_per_node 2 scripts/bench/trainer.py \
        --flavor debugmodel_moe --ep 2 --batch 4 --steps 5
    .venv/bin/torchrun --standalone --nproc_per_node 2 scripts/bench/trainer.py \
        --model deepseek_v3 --flavor debugmodel --ep 2 --batch 4 --steps 8
    .venv/bin/python scripts/bench/trainer.py --lengths longtail --ac full --steps 2 --warmup 0
    .venv/bin/python scripts/bench/trainer.py --lengths longtail --flavor 0.6B --sequences 4 \
        --max_completion 2048 --steps 1 --warmup 0 --ac full
    .venv/bin/torchrun --standalone --nproc_per_node 2 scripts/bench/trainer.py --model llama3 \
        --checkpoint assets/smollm2_135m_instruct --lengths rows --rows ROWS.json
    scripts/gpu_trainer.sh        (a GPU: 0.6B, 1.7B, 4B in bf16; docs/performance.md)

Against plain (`--compare plain`, the default for uniform rows; under torchrun): both sides use
the trainer's FSDP-sharded model (`--dtype`: model.dtype; `--compile`: training.compile, which
compiles that one model's blocks, so both sides run them compiled) and torchtitan optimizer:
"plain" is forward, torchtitan's `cross_entropy_loss` over full logits, backward, grad
clipping, optimizer and LR-scheduler step; "ours" is `optimizer_step` (packed, the default)
with a token-mean policy-gradient loss. Uniform rows: `--batch` rows of `--seq` tokens per
rank, plain runs them as they are. Long-tailed rows (`--lengths longtail --compare plain`):
the mix below, each rank its contiguous share; plain runs the share as torchtitan's trainer
packs documents, one stream cut into equal rows of at most `--budget` tokens (document-causal
attention, positions restarting per piece). Real rollouts (`--lengths rows --rows FILE`, the
rows `scripts/bench/e2e.py --rows_out FILE` records: every rank's rows of every step of a real
run, their token ids and prompt lengths): timed step i trains step i's rows (cycling), each rank
its own, plain packing them as the long tail's; `ratio` is then the two sides' total time over
the timed steps. `--checkpoint DIR`: the HF checkpoint's weights and shape (`model.flavor =
"auto"`, `--model` its family). Steps alternate between the two so machine noise
hits both alike. Rank 0 prints one JSON line: median tokens/s of each, `ratio` = ours / plain,
`mfu` of each (`flops` says the formula: torchtitan's own `get_nparams_and_flops`; `peak_gflops`
and `peak` the denominator: on CUDA `--peak_tflops` per GPU, on CPU a GEMM in `--dtype`
measured on every rank in this run), `peak_device_gib` of each (CUDA's max_memory_allocated,
reset before every step; null on CPU, where `peak_rss_gib_per_rank` is the process's, both
sides together), `host_syncs` of one more step of each (CUDA's sync debug mode, one warning
per wait; null on CPU) and `compiled_graphs` (Dynamo's count: 0 means nothing was compiled).

Packed against padded (`--lengths longtail`, run with python; it launches one 2-rank torchrun
world per path, watched for memory): a seeded mix of `--sequences` sequences, prompts uniform
in 64-640 tokens, completions lognormal with median 200 and 5% above 1,500 (sigma 1.225),
capped at `--max_completion`. Each rank holds a contiguous share, as it would the samples of its own
prompts. "padded" is the path before packing (`training.micro_batch_tokens = 0`): the share
right-padded to its longest, full logits; "packed" is `optimizer_step` under `--budget` tokens:
it redeals rows over the ranks by tokens, packs them, runs the LM head at scored tokens only.
Prints one JSON line: real (non-padding) tokens/s of each path (median step),
`speedup` = packed / padded, each path's rank token loads and `load_imbalance` (max / min),
peak RSS per rank and of the whole tree, `peak_rss_ratio` = packed / padded (per-rank maxima),
and what the paths do not change: the peak of building the trainer
(`built_peak_rss_gib_per_rank`) and the gradients and AdamW moments a step adds
(`grad_adam_gib_per_rank`, 3x the rank's parameter shard); `transient_rss_ratio` is the
packed / padded ratio of the rest (`transient_gib`: activations, logits, temporaries);
a path that ran the machine out of memory (available < `--min_free_gib`) reports
`completed: false`, and a line on stderr says so. On a 24 GiB machine the padded path at
debugmodel fits with `--ac full` only (the figure docs/trainer_and_generator.md quotes).
The long tail's default flavor is debugmodel; a flavor with fewer positions than the mix's
longest sequence is refused in one line.
"""

import argparse
import functools
import itertools
import json
import math
import random
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from children import REPO, MemoryWatch, peak_rss_gib, report, run_child
from torch._dynamo.utils import counters
from torchtitan.components.loss import cross_entropy_loss
from torchtitan.distributed import utils as dist_utils

from torchtitan_rl import platform
from torchtitan_rl.checkpoint import save_bytes
from torchtitan_rl.config import ModelSection, ParallelismSection, TrainingSection
from torchtitan_rl.trainer import packing
from torchtitan_rl.trainer.attention import documents
from torchtitan_rl.trainer.policy_trainer import PolicyTrainer
from torchtitan_rl.types import LossScale, RolloutBatch

TOKENIZER = REPO / "assets" / "tiny_qwen3"
# The completion-length distribution: median 200 tokens, P(> 1,500) = 5%.
MEDIAN, SIGMA = 200, math.log(1500 / 200) / 1.645


def pg_loss(logprobs_BT: torch.Tensor, batch: RolloutBatch, scale: LossScale):
    weighted_BT = batch.advantages_B[:, None] * logprobs_BT * batch.loss_mask_BT
    return -weighted_BT.sum() / scale.tokens, {}


def plain_update(trainer: PolicyTrainer, max_norm: float) -> None:
    """The plain step's end: clip, AdamW and the LR schedule, as torchtitan's trainer steps."""
    dist_utils.clip_grad_norm_(
        list(trainer.model.parameters()),
        max_norm=max_norm,
        ep_enabled=trainer.parallel_dims.ep_enabled,
    )
    trainer.optimizers.step()
    trainer.lr_schedulers.step()
    trainer.optimizers.zero_grad()


def plain_step(trainer: PolicyTrainer, tokens_BT: torch.Tensor, max_norm: float) -> None:
    tokens_BT = tokens_BT.to(platform.device())  # (the trainer's own step moves its batch)
    positions_BT = torch.arange(tokens_BT.shape[1], device=tokens_BT.device).expand_as(tokens_BT)
    logits_BTV = trainer.model(tokens_BT, positions=positions_BT)
    loss = cross_entropy_loss(logits_BTV[:, :-1], tokens_BT[:, 1:]) / tokens_BT[:, 1:].numel()
    loss.backward()
    plain_update(trainer, max_norm)


def build_trainer(args, micro_batch_tokens: int) -> PolicyTrainer:
    if args.checkpoint:
        model = ModelSection(name=args.model, hf_checkpoint=args.checkpoint, dtype=args.dtype)
    else:
        tiny = args.flavor == "tiny"
        model = ModelSection(
            name=args.model,
            flavor=args.flavor,
            hf_checkpoint=str(TOKENIZER) if tiny else None,
            tokenizer_path=str(TOKENIZER),
            dtype=args.dtype,
        )
    training = TrainingSection(
        lr=1e-4,
        steps=10_000,
        max_grad_norm=1.0,
        micro_batch_tokens=micro_batch_tokens,
        activation_checkpoint=args.ac,
        compile=args.compile,
    )
    parallelism = ParallelismSection(ep=args.ep)
    return PolicyTrainer(model=model, training=training, parallelism=parallelism)


FLOPS_FORMULA = (
    "torchtitan's get_nparams_and_flops per token: 6 * N (the matmul parameters, MoE's "
    "active ones; embedding out unless tied) + 6 * layers * heads * (qk + v head dims) * "
    "seq_len, seq_len = the token's sequence (causal not halved); both sides credited the "
    "same FLOPs"
)


def model_flops(trainer: PolicyTrainer, lengths: list[int]) -> float:
    """Model FLOPs of training sequences of `lengths` (forward and backward), by torchtitan's
    own per-token formula at each sequence's length."""
    config = trainer.spec.model
    dense = config.get_nparams_and_flops(trainer.model, 0)[1]  # 6 N
    attention = config.get_nparams_and_flops(trainer.model, 1)[1] - dense  # per position
    return float(sum(n * (dense + attention * n) for n in lengths))


def peak_gflops(args, world: int) -> tuple[float, str]:
    """The world's peak GFLOP/s in --dtype and how it was found: on CUDA --peak_tflops per GPU;
    on CPU each rank's best GEMM rate (2048^3, --dtype, its own threads), all ranks at once,
    summed, measured in this run as scripts/bench/e2e.py does."""
    if torch.cuda.is_available():
        return args.peak_tflops * 1e3 * world, f"--peak_tflops {args.peak_tflops} per GPU"
    size, dtype = 2048, getattr(torch, args.dtype)
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    best = math.inf
    dist.barrier()
    for _ in range(4):  # the first warms up
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    rates = platform.all_gather_objects(2 * size**3 / best / 1e9)
    how = f"{args.dtype} GEMM {size}^3 measured on each rank's {torch.get_num_threads()} threads"
    return sum(rates), how


def host_syncs(step) -> int | None:
    """How many times `step()` makes the host wait for the GPU (CUDA's sync debug mode, one
    warning each); None on CPU, where nothing waits."""
    if not torch.cuda.is_available():
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchronizing CUDA operation" in str(w.message) for w in caught)


def plain_packed_step(trainer: PolicyTrainer, rows: list[list[int]], tokens: list, max_norm):
    """The plain step on packed rows, as torchtitan's trainer packs documents into rows: each
    row's `tokens` (its pieces of sequences, back to back), positions restarting per piece,
    document-causal attention, full logits and cross-entropy at every position."""
    device = platform.device()
    total = sum(len(t) - 1 for t in tokens)
    for lengths, tokens_L in zip(rows, tokens, strict=True):
        tokens_1L = platform.upload(tokens_L[None], device)
        positions_1L = platform.upload(torch.cat([torch.arange(n) for n in lengths])[None], device)
        docs = packing.upload_documents(documents(lengths, torch.device("cpu")), device)
        logits_1LV = trainer.model(tokens_1L, positions=positions_1L, attention_masks=docs)
        loss = cross_entropy_loss(logits_1LV[:, :-1], tokens_1L[:, 1:]) / total
        loss.backward()
    plain_update(trainer, max_norm)


def plain_rows(
    batch: RolloutBatch, lengths: list[int], budget: int
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """This rank's sequences (`lengths` tokens of `batch`'s rows) as one stream cut into equal
    rows (as many as the rank with the most tokens needs at `budget` each, so every rank runs
    as many forwards), the cuts falling inside sequences as torchtitan's packed rows do: each
    row's piece lengths and tokens."""
    stream = torch.cat([batch.tokens_BT[b, :n] for b, n in enumerate(lengths)])
    most = torch.tensor([math.ceil(stream.numel() / budget)])
    platform.all_reduce_host(most, op=dist.ReduceOp.MAX)
    count = int(most[0])
    cuts = [round(i * stream.numel() / count) for i in range(count + 1)]
    starts = [0, *itertools.accumulate(lengths)]
    rows = []
    for lo, hi in zip(cuts, cuts[1:], strict=False):
        edges = sorted({lo, hi, *(s for s in starts if lo < s < hi)})
        rows.append([b - a for a, b in zip(edges, edges[1:], strict=False)])
    return rows, [stream[lo:hi] for lo, hi in zip(cuts, cuts[1:], strict=False)]


def recorded_steps(path: str, rank: int, world: int) -> list[tuple[RolloutBatch, list[int]]]:
    """This rank's rows of every step `path` holds (scripts/bench/e2e.py --rows_out), each step
    as a right-padded RolloutBatch (loss on the completions, random advantages) and its
    sequences' lengths."""
    ranks = json.loads(Path(path).read_text())["ranks"]
    if len(ranks) != world:
        sys.exit(f"error: --rows {path} holds {len(ranks)} ranks' rows: run {len(ranks)} ranks")
    g = torch.Generator().manual_seed(rank)
    steps = []
    for rows in ranks[rank]:
        lengths = [len(ids) for _, ids in rows]
        tokens_BT = torch.zeros(len(rows), max(lengths), dtype=torch.long)
        mask_BT = torch.zeros(len(rows), max(lengths))
        for b, (prompt, ids) in enumerate(rows):
            tokens_BT[b, : len(ids)] = torch.tensor(ids)
            mask_BT[b, prompt : len(ids)] = 1.0
        batch = RolloutBatch(
            tokens_BT=tokens_BT,
            loss_mask_BT=mask_BT,
            advantages_B=torch.randn(len(rows), generator=g),
            generator_logprobs_BT=torch.zeros_like(mask_BT),
        )
        steps.append((batch, lengths))
    return steps


def versus_plain(args) -> None:
    """Ours (`optimizer_step`) against the plain torchtitan step on the same rows, alternating."""
    rank, world = platform.init_distributed()
    trainer = build_trainer(args, micro_batch_tokens=args.budget)
    vocab = trainer.spec.model.vocab_size
    recorded = []  # --lengths rows: (batch, lengths, plain's rows) of each recorded step
    if args.lengths == "rows":
        for batch, lengths in recorded_steps(args.rows, rank, world):
            recorded.append((batch, lengths, plain_rows(batch, lengths, args.budget)))
        batch, lengths, _ = recorded[0]

        def plain(i):
            _, _, (rows, row_tokens) = recorded[i % len(recorded)]
            plain_packed_step(trainer, rows, row_tokens, 1.0)

        def ours(i):
            trainer.optimizer_step(recorded[i % len(recorded)][0], pg_loss)

    elif args.lengths == "uniform":
        g = torch.Generator().manual_seed(rank)
        tokens_BT = torch.randint(0, vocab, (args.batch, args.seq), generator=g)
        batch = RolloutBatch(
            tokens_BT=tokens_BT,
            loss_mask_BT=torch.ones(args.batch, args.seq),
            advantages_B=torch.randn(args.batch, generator=g),
            generator_logprobs_BT=torch.zeros(args.batch, args.seq),
        )
        lengths = [args.seq] * args.batch

        def plain(i):
            plain_step(trainer, tokens_BT, 1.0)

    else:
        mix = longtail_mix(args.sequences, args.max_completion, args.seed)
        per_rank = math.ceil(len(mix) / world)
        share = list(range(len(mix)))[rank * per_rank : (rank + 1) * per_rank]
        batch = rank_batch(mix, share, vocab, args.seed + rank)
        lengths = [sum(mix[i]) for i in share]
        rows, row_tokens = plain_rows(batch, lengths, args.budget)

        def plain(i):
            plain_packed_step(trainer, rows, row_tokens, 1.0)

    if not recorded:

        def ours(i):
            trainer.optimizer_step(batch, pg_loss)

    cuda = torch.cuda.is_available()
    sides = {"ours": ours, "plain": plain}
    times: dict[str, list[float]] = {"ours": [], "plain": []}
    peak_bytes = dict.fromkeys(sides, 0)
    for i in range(args.warmup + args.steps):
        for kind, step in sides.items():
            dist.barrier()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            step(i)
            if cuda:  # the step's kernels done, not only queued
                torch.cuda.synchronize()
                peak_bytes[kind] = max(peak_bytes[kind], torch.cuda.max_memory_allocated())
            dist.barrier()
            if i >= args.warmup:
                times[kind].append(time.perf_counter() - start)
    syncs = {kind: host_syncs(functools.partial(step, 0)) for kind, step in sides.items()}
    compiled = counters["stats"]["unique_graphs"]

    if recorded:  # steps of different sizes: a mean step of the timed ones, both sides
        timed = [
            recorded[i % len(recorded)][1] for i in range(args.warmup, args.warmup + args.steps)
        ]
        flops = sum(model_flops(trainer, lengths) for lengths in timed) / len(timed)
        tokens = sum(sum(lengths) for lengths in timed) / len(timed)
        step_s = {kind: statistics.mean(t) for kind, t in times.items()}
    else:
        flops, tokens = model_flops(trainer, lengths), sum(lengths)
        step_s = {kind: statistics.median(t) for kind, t in times.items()}
    flops = sum(platform.all_gather_objects(flops))
    tokens = sum(platform.all_gather_objects(tokens))
    peak, peak_how = peak_gflops(args, world)
    rss = platform.all_gather_objects(round(peak_rss_gib(), 3))
    if rank == 0:
        row = {
            "bench": "trainer",
            "lengths": args.lengths,
            "compare": "plain",
            "model": args.model,
            "flavor": args.flavor,
            "checkpoint": args.checkpoint,
            "dtype": args.dtype,
            "compile": args.compile,
            "compiled_graphs": compiled,
            "nproc": world,
            "ep": args.ep,
            "budget": args.budget,
        }
        if args.lengths == "uniform":
            row |= {"batch_per_rank": args.batch, "seq": args.seq}
        elif recorded:
            row |= {"rows": args.rows, "recorded_steps": len(recorded)}
        else:
            row |= {"sequences": args.sequences, "max_completion": args.max_completion}
        row |= {
            "tokens_per_step": tokens,
            "tokens_per_s": round(tokens / step_s["ours"], 1),
            "plain_tokens_per_s": round(tokens / step_s["plain"], 1),
            "ratio": round(step_s["plain"] / step_s["ours"], 3),
            "mfu": {k: round(flops / t / 1e9 / peak, 4) for k, t in step_s.items()},
            "model_tflop_per_step": round(flops / 1e12, 4),
            "flops": FLOPS_FORMULA,
            "peak_gflops": round(peak, 1),
            "peak": peak_how,
            "peak_device_gib": (
                {k: round(b / 2**30, 3) for k, b in peak_bytes.items()} if cuda else None
            ),
            "peak_rss_gib_per_rank": rss,
            "host_syncs": syncs if cuda else None,
        }
        print(json.dumps(row), flush=True)
    platform.shutdown_distributed()


def longtail_mix(sequences: int, max_completion: int, seed: int) -> list[tuple[int, int]]:
    """(prompt tokens, completion tokens) of each sequence of the seeded long-tailed mix."""
    rng = random.Random(seed)
    mix = []
    for _ in range(sequences):
        completion = round(rng.lognormvariate(math.log(MEDIAN), SIGMA))
        mix.append((rng.randint(64, 640), max(1, min(max_completion, completion))))
    return mix


def rank_batch(mix: list[tuple[int, int]], rows: list[int], vocab: int, seed: int):
    """The right-padded RolloutBatch of `mix[rows]`: random ids, loss on the completions."""
    g = torch.Generator().manual_seed(seed)
    width = max(sum(mix[i]) for i in rows)
    tokens_BT = torch.zeros(len(rows), width, dtype=torch.long)
    mask_BT = torch.zeros(len(rows), width)
    for b, i in enumerate(rows):
        prompt, completion = mix[i]
        tokens_BT[b, : prompt + completion] = torch.randint(
            0, vocab, (prompt + completion,), generator=g
        )
        mask_BT[b, prompt : prompt + completion] = 1.0
    return RolloutBatch(
        tokens_BT=tokens_BT,
        loss_mask_BT=mask_BT,
        advantages_B=torch.randn(len(rows), generator=g),
        generator_logprobs_BT=torch.zeros(len(rows), width),
    )


def longtail_child(args) -> None:
    """One path (`args.path`) on the mix in this torchrun world; reports its figures."""
    rank, world = platform.init_distributed()
    packed = args.path == "packed"
    trainer = build_trainer(args, micro_batch_tokens=args.budget if packed else 0)
    mix = longtail_mix(args.sequences, args.max_completion, args.seed)
    lengths = [p + c for p, c in mix]
    # Each rank holds the samples of its own prompts, in draw order; packed, optimizer_step deals
    # them anew by tokens (PolicyTrainer._deal), which `shares` then replays.
    per_rank = math.ceil(len(mix) / world)
    shares = [list(range(len(mix)))[r * per_rank : (r + 1) * per_rank] for r in range(world)]
    batch = rank_batch(mix, shares[rank], trainer.spec.model.vocab_size, args.seed + rank)
    if packed:
        dealt = packing.rebalance([[lengths[i] for i in share] for share in shares])
        shares = [[shares[r][i] for r, i in share] for share in dealt]
    # What building the trainer peaked at (weights, allocator); a step adds the gradients and
    # AdamW's two moments (3x this rank's shard of the trained parameters, as a checkpoint
    # holds: `save_bytes`; the same on both paths) and its transient memory (activations,
    # logits), which is where the paths differ.
    built = platform.all_gather_objects(peak_rss_gib())
    state = platform.all_gather_objects(save_bytes(trainer) / 2**30)
    times = []
    for i in range(args.warmup + args.steps):
        dist.barrier()
        start = time.perf_counter()
        trainer.optimizer_step(batch, pg_loss)
        dist.barrier()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    rss = platform.all_gather_objects(peak_rss_gib())
    if rank == 0:
        report(
            {
                "step_s": statistics.median(times),
                "rank_tokens": [sum(lengths[i] for i in share) for share in shares],
                "rank_padded_tokens": [
                    len(share) * max((lengths[i] for i in share), default=0) for share in shares
                ],
                "peak_rss_gib_per_rank": [round(gib, 3) for gib in rss],
                "built_peak_rss_gib_per_rank": [round(gib, 3) for gib in built],
                "grad_adam_gib_per_rank": [round(gib, 3) for gib in state],
            }
        )
    platform.shutdown_distributed()


def longtail(args, passthrough: list[str]) -> None:
    mix = longtail_mix(args.sequences, args.max_completion, args.seed)
    completions = sorted(c for _, c in mix)
    real_tokens = sum(p + c for p, c in mix)
    row = {
        "bench": "trainer",
        "lengths": "longtail",
        "flavor": args.flavor,
        "nproc": args.nproc,
        "sequences": args.sequences,
        "budget": args.budget,
        "activation_checkpoint": args.ac,
        "dtype": args.dtype,
        "compile": args.compile,
        "real_tokens": real_tokens,
        "completion_median": completions[len(completions) // 2],
        "completion_max": completions[-1],
        "completions_over_1500": sum(c > 1500 for c in completions),
    }
    script = str(Path(__file__).resolve())
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    for path in ("packed", "padded"):
        command = [*torchrun, "--nproc_per_node", str(args.nproc), script, "--child", path]
        with tempfile.TemporaryDirectory(), MemoryWatch(args.min_free_gib) as watch:
            try:
                result = run_child([*command, *passthrough])
            except SystemExit:
                if not watch.fired:
                    raise
                result = {"completed": False, "stopped": f"available < {args.min_free_gib} GiB"}
        if "step_s" in result:
            result["tokens_per_s"] = round(real_tokens / result.pop("step_s"), 1)
            loads = result["rank_tokens"]
            result["load_imbalance"] = round(max(loads) / max(min(loads), 1), 3)
        result["tree_peak_rss_gib"] = round(watch.peak / 2**30, 3)
        row[path] = result
    packed, padded = row["packed"], row["padded"]
    for path in ("packed", "padded"):
        if row[path].get("completed") is False:
            print(
                f"trainer bench: the {path} path ran out of memory (available < "
                f"{args.min_free_gib} GiB, the tree at {row[path]['tree_peak_rss_gib']} GiB): no "
                "comparison at this size; --ac full, fewer --sequences or a lower "
                "--max_completion fit",
                file=sys.stderr,
            )
    if "tokens_per_s" in packed and "tokens_per_s" in padded:
        row["speedup"] = round(packed["tokens_per_s"] / padded["tokens_per_s"], 3)
    if "peak_rss_gib_per_rank" in packed and "peak_rss_gib_per_rank" in padded:
        ratio = max(packed["peak_rss_gib_per_rank"]) / max(padded["peak_rss_gib_per_rank"])
        row["peak_rss_ratio"] = round(ratio, 3)
        # The steps' transient memory: each rank's peak above its build peak and its gradients
        # and AdamW moments.
        transient = {
            path: max(
                peak - built - state
                for peak, built, state in zip(
                    row[path]["peak_rss_gib_per_rank"],
                    row[path]["built_peak_rss_gib_per_rank"],
                    row[path]["grad_adam_gib_per_rank"],
                    strict=True,
                )
            )
            for path in ("packed", "padded")
        }
        row["transient_gib"] = {path: round(gib, 3) for path, gib in transient.items()}
        row["transient_rss_ratio"] = round(transient["packed"] / max(transient["padded"], 1e-9), 3)
    print(json.dumps(row), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", choices=("uniform", "longtail", "rows"), default="uniform")
    parser.add_argument("--rows", help="--lengths rows: scripts/bench/e2e.py --rows_out's file")
    parser.add_argument("--checkpoint", help="an HF checkpoint folder (its shape, its weights)")
    parser.add_argument(
        "--compare",
        choices=("plain", "padded"),
        help="ours against the plain torchtitan step (default for uniform; under torchrun) or, "
        "longtail, packed against padded micro-batches (its default; launches its worlds)",
    )
    parser.add_argument("--model", default="qwen3", help="uniform: the family (deepseek_v3, ...)")
    parser.add_argument(
        "--flavor",
        help="qwen3 flavor: tiny, debugmodel, 0.6B (default: tiny; longtail: debugmodel)",
    )
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="training.compile: torchtitan's per-block torch.compile (both sides: one model)",
    )
    parser.add_argument(
        "--peak_tflops",
        type=float,
        default=989.0,
        help="CUDA: one GPU's peak for MFU (989: H100/H200 SXM bf16 dense); CPU measures it",
    )
    parser.add_argument("--batch", type=int, default=8, help="uniform: sequences per rank")
    parser.add_argument("--seq", type=int, default=128, help="uniform: tokens per sequence")
    parser.add_argument("--sequences", type=int, default=16, help="longtail: sequences in all")
    parser.add_argument("--max_completion", type=int, default=4096, help="longtail: the cap")
    parser.add_argument("--budget", type=int, default=8192, help="packed tokens (0: padded)")
    parser.add_argument("--seed", type=int, default=0, help="longtail: the mix's seed")
    parser.add_argument("--nproc", type=int, default=2, help="longtail: ranks per world")
    parser.add_argument("--min_free_gib", type=float, default=1.5, help="longtail: stop below")
    parser.add_argument("--ac", default="none", choices=("none", "full", "selective"))
    parser.add_argument("--ep", type=int, default=1, help="expert parallel (MoE flavors)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps of each kind")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--child", choices=("packed", "padded"), dest="path")
    argv = sys.argv[1:]
    args = parser.parse_args(argv)
    if args.checkpoint:
        args.flavor = "auto"  # the checkpoint's shape (its config.json)
    elif args.flavor is None:
        args.flavor = "debugmodel" if args.lengths == "longtail" else "tiny"
    if args.compare is None:
        args.compare = "padded" if args.lengths == "longtail" else "plain"
    if args.lengths == "rows" and not args.rows:
        parser.error("--lengths rows needs --rows FILE (scripts/bench/e2e.py --rows_out FILE)")
    if args.lengths == "uniform" and args.compare == "padded":
        parser.error("--compare padded needs --lengths longtail (uniform rows have no padding)")
    if args.lengths == "longtail":
        from torchtitan_rl.models import model_spec

        positions = model_spec("qwen3", args.flavor).model.max_seq_len
        longest = max(
            p + c for p, c in longtail_mix(args.sequences, args.max_completion, args.seed)
        )
        if positions < longest:
            parser.error(
                f"--flavor {args.flavor} holds {positions} positions but the long tail's longest "
                f"sequence has {longest} tokens: use --flavor debugmodel (4,096) or a lower "
                "--max_completion"
            )
    platform.patch_torchtitan()
    if args.path is not None:
        longtail_child(args)
    elif args.compare == "padded":
        longtail(args, argv)
    else:
        versus_plain(args)


if __name__ == "__main__":
    main()
    platform.exit_process(0)
