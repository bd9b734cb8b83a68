"""Benchmark whole RL steps: the train entry point's config and flags, one JSON line of figures.

    .venv/bin/python scripts/bench/e2e.py --nproc 2 [--peer trl|trl-vllm] \
        --job.config_file run_configs/debug_cpu.toml --training.steps 20 [--batch_invariant true]

Runs RLTrainer for `training.steps` steps under `torchrun --nproc_per_node N` and prints the
median over steps 2.. (step 1 warms up) of the step time and its generate / score / train /
weight-sync / other split, the generated tokens per second, and the run's shape. Before the run
it measures `peak_gflops`, the best fp32 GEMM rate of N threads here, and reports `mfu`: the
step's model FLOPs (2 N_params per prompt and generated token, 6 N_params per trained token)
/ step time / peak. With `--peer trl` (HF generate) or `--peer trl-vllm` (TRL's colocated
vLLM, as its users run it; `--peer_micro_batches M`: its step's gradient accumulated over M
micro-batches) it then runs TRL's GRPOTrainer on the same flags (scripts/bench/trl_peer.py, N
threads in one process) and adds `trl_step_s`,
`trl_ratio` = TRL step / our step, and TRL's completion lengths (mean over steps, and max)
beside ours (`response_length_mean`, `response_length_max`). `trained_tokens_per_s`: completion
tokens trained per second of wall time; `trainer_busy` and `generator_busy`: the median share
of a step each side works (colocated: the share each phase takes of the ranks' step;
continuous: the generator's engine-step time since its previous batch); `peak_rss_gib_per_rank`
and `peak_rss_gib_children_per_rank` (a generator rank's engine process). With
`--batch_invariant true` it runs the same config with the mode off too and adds `cost_ratio`:
step time on / off; and where a side is tensor parallel, `canonical_cost_ratio`: step time with
the row-parallel layers' canonical reduction / with their plain one (the mode's check warning).
With a distill teacher (`--distill.teacher_checkpoint`) it runs the same
config without the teacher and with the KL reference instead (`--algorithm.kl_beta 0.001`), and
adds `teacher_cost_ratio` and `reference_cost_ratio`: step time with each / without either.

With a held-out set (a reasoning-gym task's, or eval.dataset_path) our run is evaluated before
its first step and after its last (`eval_accuracy_start`, `eval_accuracy`), and the TRL peer
trains for as long as our steps took (`--wall_s`: `steps_s`, the sum of our step times), then is
evaluated the same way (`trl_eval_accuracy`, `trl_steps_done`): the held-out accuracy of each
after the same wall-clock time. `--rows_out FILE`: every rank's trained rows of every step
(prompt length and token ids, JSON) for `scripts/bench/trainer.py --rows FILE`, the trainer
against plain torchtitan on real rollout lengths.
"""

import json
import statistics
import subprocess
import sys
import time

from children import REPO, children_peak_rss_gib, join_world, peak_rss_gib, report, run_child

from torchtitan_rl import platform
from torchtitan_rl.config import ConfigError, parse_args
from torchtitan_rl.loop import Hooks
from torchtitan_rl.placements.colocated import RLTrainer


class Collect(Hooks):
    def __init__(self):
        self.rows: list[dict[str, float]] = []

    def after_step(self, step: int, metrics: dict[str, float]) -> None:
        self.rows.append(metrics)


def record_rows(trainer: RLTrainer, steps: list) -> None:
    """Append to `steps` each optimizer step's rows of this rank: [prompt tokens, token ids]."""
    policy = trainer.learner.trainer
    step_fn = policy.optimizer_step

    def recorded(batch, loss_fn, **kwargs):
        rows = []
        for tokens_T, mask_T in zip(batch.tokens_BT, batch.loss_mask_BT, strict=True):
            scored = mask_T.nonzero().flatten().tolist()
            rows.append([scored[0], tokens_T[: scored[-1] + 1].tolist()])
        steps.append(rows)
        return step_fn(batch, loss_fn, **kwargs)

    policy.optimizer_step = recorded


def measure(flags: list[str]) -> int:
    """The child, one rank of the torchrun world: train, then report the figures (rank 0)."""
    rows_out = None
    if flags[:1] == ["--rows_out"]:
        rows_out, flags = flags[1], flags[2:]
    if flags[:1] == ["--plain_reduction"]:
        # Under the mode with a TP side: the row-parallel layers reduce as without the mode
        # (one GEMM on one device, each TP rank's plain partial summed over the ranks), so that
        # the canonical reduction's own cost shows; the mode's check then warns.
        from torchtitan_rl import batch_invariant

        batch_invariant.reduction_slices = lambda *degrees: 1
        flags = [*flags[1:], "--batch_invariant_on_mismatch", "warn"]
    config, rank, world = join_world(flags, prog="scripts/bench/e2e.py")
    collect = Collect()
    if config.generator.placement in ("disaggregated", "continuous"):
        from torchtitan_rl.placements import continuous, disaggregated

        placement = disaggregated if config.generator.placement == "disaggregated" else continuous
        placement.run(config, hooks=collect)  # rank 0 trains, and collects
        flops, evals = None, [None, None]
    else:
        trainer = RLTrainer(config, hooks=collect)
        rows: list = []
        if rows_out:
            record_rows(trainer, rows)
        evals = [trainer.evaluate(0)]
        for step in range(1, config.training.steps + 1):
            trainer.train_step(step)
        evals.append(trainer.evaluate(config.training.steps))
        flops = model_flops(trainer, collect.rows)
        if rows_out:
            every_rank = platform.all_gather_objects(rows)
            if rank == 0:
                with open(rows_out, "w") as f:
                    json.dump({"ranks": every_rank}, f)
    # Each rank's peak RSS, and its children's (a generator rank's engine process).
    memory = platform.all_gather_objects((peak_rss_gib(), children_peak_rss_gib()))
    platform.shutdown_distributed()
    if rank == 0:
        timed = collect.rows[1:] or collect.rows

        def median(key: str) -> float:
            return round(statistics.median(r[key] for r in timed), 4)

        split = ("time/generate_s", "time/env_s", "time/train_s", "time/weight_sync_s")
        other = [r["time/step_s"] - sum(r.get(k, 0.0) for k in split) for r in timed]
        report(
            {
                "step_s": median("time/step_s"),
                "generate_s": median("time/generate_s"),
                "env_s": median("time/env_s") if "time/env_s" in timed[0] else None,
                "train_s": median("time/train_s"),
                "weight_sync_s": median("time/weight_sync_s"),
                "other_s": round(statistics.median(other), 4),
                "model_tflop_per_step": round(flops / 1e12, 4) if flops else None,
                "generated_tokens_per_s": median("throughput/generated_tokens_per_s"),
                "response_length": median("response_length/mean"),
                "response_length_mean": round(
                    statistics.mean(r["response_length/mean"] for r in collect.rows), 2
                ),
                "response_length_max": max(r["response_length/max"] for r in collect.rows),
                "final_reward": round(collect.rows[-1]["reward/mean"], 4),
                # Every step, the first (warm-up) included: the peer's wall-clock budget.
                "steps_s": round(sum(r["time/step_s"] for r in collect.rows), 2),
                "eval_accuracy_start": evals[0] and evals[0]["eval/accuracy"],
                "eval_accuracy": evals[-1] and evals[-1]["eval/accuracy"],
                "logprob_diff_max": max(r["logprob_diff/max"] for r in collect.rows),
                "weight_sync_gb_per_s": median("weight_sync/gb_per_s")
                if "weight_sync/gb_per_s" in timed[0]
                else None,
                # Completion tokens trained per second of wall time, over the timed steps.
                "trained_tokens_per_s": round(
                    sum(r["generated_tokens"] for r in timed)
                    / sum(r["time/step_s"] for r in timed),
                    2,
                ),
                "trainer_busy": busy(timed, ("time/train_s", "time/weight_sync_s")),
                "generator_busy": round(
                    statistics.median(r["continuous/generator_busy"] for r in timed), 3
                )
                if config.generator.placement == "continuous"
                else busy(timed, ("time/generate_s", "time/env_s")),
                "peak_rss_gib_per_rank": [round(own, 2) for own, _ in memory],
                "peak_rss_gib_children_per_rank": [round(kids, 2) for _, kids in memory],
                "placement": config.generator.placement,
                "max_offpolicy_steps": config.algorithm.max_offpolicy_steps,
                "model_path": config.model.hf_checkpoint,
                "prompts_per_step": config.training.prompts_per_step,
                "group_size": config.generator.sampling.n,
                "max_tokens": config.generator.sampling.max_tokens,
                "nproc": world,
                "steps": config.training.steps,
            }
        )
    return 0


def busy(rows: list[dict], parts: tuple[str, ...]) -> float:
    """The median share of a step's wall time spent in `parts` (a side's busy fraction: the
    trainer's, or where one step's generation is timed whole, the generator's)."""
    return round(
        statistics.median(sum(r.get(p, 0.0) for p in parts) / r["time/step_s"] for r in rows), 3
    )


def model_flops(trainer: RLTrainer, rows: list[dict]) -> float:
    """Model FLOPs of a median step: 2 N per prompt token (prefill) and generated token, 6 N
    per trained token (forward and backward over prompt + completion); N = all parameters."""
    params = sum(p.numel() for p in trainer.learner.trainer.named_parameters().values())
    n = trainer.config.generator.sampling.n
    prompts = trainer.producer.task.prompts(1, trainer.config.training.prompts_per_step)
    prompt_tokens = sum(len(ids) for ids in trainer.producer.renderer.encode(prompts)) * n
    generated = statistics.median(r["generated_tokens"] for r in rows)
    return 2 * params * (prompt_tokens + generated) + 6 * params * (prompt_tokens + generated)


def peak_gflops(threads: int, size: int = 2048, repeats: int = 5) -> float:
    """The best fp32 GEMM rate of `threads` threads here, in a child (a clean thread pool)."""
    code = f"""
import time, torch
torch.set_num_threads({threads})
a, b = torch.randn({size}, {size}), torch.randn({size}, {size})
times = []
for _ in range({repeats} + 1):  # the first warms up
    start = time.perf_counter()
    a @ b
    times.append(time.perf_counter() - start)
print(2 * {size}**3 / min(times) / 1e9)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip())


def run(
    nproc: int, flags: list[str], rows_out: str | None = None, plain_reduction: bool = False
) -> dict:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    script = str(REPO / "scripts" / "bench" / "e2e.py")
    ours = ["--rows_out", rows_out] if rows_out else []
    ours += ["--plain_reduction"] if plain_reduction else []
    return run_child([*torchrun, "--nproc_per_node", str(nproc), script, "--child", *ours, *flags])


def run_peer(threads: int, flags: list[str], peer_flags: tuple[str, ...] = ()) -> dict:
    """TRL's GRPOTrainer on the same flags (scripts/bench/trl_peer.py, with `peer_flags`: its
    own, `--vllm`, `--micro_batches M`); its JSON line."""
    script = str(REPO / "scripts" / "bench" / "trl_peer.py")
    began = time.perf_counter()
    command = [sys.executable, script, "--threads", str(threads), *peer_flags, *flags]
    child = subprocess.run(command, capture_output=True, text=True)
    lines = [line for line in child.stdout.splitlines() if line.startswith("{")]
    if child.returncode != 0 or not lines:
        sys.exit(
            f"trl_peer.py failed after {time.perf_counter() - began:.0f} s:\n{child.stderr[-3000:]}"
        )
    return json.loads(lines[-1])


def main() -> int:
    args = sys.argv[1:]
    if args[:1] == ["--child"]:
        return measure(args[1:])
    nproc, peer, peer_micro_batches, rows_out = 1, None, 1, None
    while args[:1] in (["--nproc"], ["--peer"], ["--peer_micro_batches"], ["--rows_out"]):
        if args[0] == "--nproc":
            nproc = int(args[1])
        elif args[0] == "--peer":
            peer = args[1]
        elif args[0] == "--rows_out":
            rows_out = args[1]
        else:
            peer_micro_batches = int(args[1])
        args = args[2:]
    if peer not in (None, "trl", "trl-vllm"):
        print(
            f"error: --peer {peer}: the peers are trl (HF generate) and trl-vllm", file=sys.stderr
        )
        return 2
    try:
        config = parse_args(args, nproc, prog="scripts/bench/e2e.py")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    peak = peak_gflops(threads=nproc)
    result = {"bench": "e2e", **run(nproc, args, rows_out), "peak_gflops": round(peak, 1)}
    if result["model_tflop_per_step"]:
        result["mfu"] = round(result["model_tflop_per_step"] * 1e3 / result["step_s"] / peak, 3)
    if peer is not None:
        peer_flags = ("--micro_batches", str(peer_micro_batches))
        if peer == "trl-vllm":
            peer_flags = ("--vllm", *peer_flags)
        if result["eval_accuracy"] is not None:  # the same wall-clock time, then its accuracy
            peer_flags = (*peer_flags, "--wall_s", str(result["steps_s"]))
        trl = run_peer(nproc, args, peer_flags)
        result["trl_peer"] = peer
        result["trl_micro_batches"] = peer_micro_batches
        result["trl_step_s"] = trl["step_s"]
        result["trl_response_length"] = trl["response_length"]
        result["trl_response_length_max"] = trl["response_length_max"]
        result["trl_ratio"] = round(trl["step_s"] / result["step_s"], 3)
        result["trl_steps_done"] = trl["steps_done"]
        result["trl_steps_s"] = trl["steps_s"]
        result["trl_eval_accuracy"] = trl["eval_accuracy"]
    if config.batch_invariant:
        off = run(nproc, [*args, "--batch_invariant", "false"])
        result["batch_invariant"] = True
        result["step_s_mode_off"] = off["step_s"]
        result["logprob_diff_max_mode_off"] = off["logprob_diff_max"]
        result["cost_ratio"] = round(result["step_s"] / off["step_s"], 3)
        tp = (config.parallelism.tp, config.generator.parallelism.tensor_parallel_degree)
        if max(tp) > 1:  # the canonical reduction of the row-parallel layers, against plain
            plain = run(nproc, args, plain_reduction=True)
            result["step_s_plain_reduction"] = plain["step_s"]
            result["canonical_cost_ratio"] = round(result["step_s"] / plain["step_s"], 3)
    if config.distill.enabled:
        plain = without_teacher(args)
        alone, reference = run(nproc, plain), run(nproc, [*plain, "--algorithm.kl_beta", "0.001"])
        result["step_s_no_teacher"] = alone["step_s"]
        result["step_s_reference_instead"] = reference["step_s"]
        result["teacher_cost_ratio"] = round(result["step_s"] / alone["step_s"], 3)
        result["reference_cost_ratio"] = round(reference["step_s"] / alone["step_s"], 3)
    print(json.dumps(result), flush=True)
    return 0


def without_teacher(args: list[str]) -> list[str]:
    """`args` less the flags of the distill teacher and of what each source learns from."""
    kept, i = [], 0
    while i < len(args):
        if args[i].startswith("--distill.") or args[i].endswith(".learn_from"):
            i += 2
            continue
        kept.append(args[i])
        i += 1
    return kept


if __name__ == "__main__":
    platform.exit_process(main())
