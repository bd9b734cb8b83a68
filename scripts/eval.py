"""Score an HF checkpoint folder (an exported policy too) on a held-out dataset; one JSON line.

    .venv/bin/python scripts/eval.py --job.config_file outputs/arith_cpu/config.toml \
        --model.hf_checkpoint outputs/arith_cpu/hf
    .venv/bin/torchrun --standalone --nproc_per_node 2 scripts/eval.py \
        --job.config_file run_configs/arith_cpu.toml --eval.dataset_path data/arith/test.parquet

It takes the run's flags (any JobConfig field; a run's written config.toml reproduces its
settings) and evaluates with the same code as the run (torchtitan_rl/evaluation.py): the same
chat template, reward, sampling seeds (job.seed, eval.n, eval.temperature) and shards. Launched
with as many processes as the run had generator ranks, it reproduces the run's eval/accuracy of
the same weights exactly. Rank 0 prints {"checkpoint", "dataset", "eval/accuracy", ...}.
"""

import json
import os
import sys

from torchtitan_rl import platform
from torchtitan_rl.config import ConfigError, parse_args


def main(argv: list[str]) -> int:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        config = parse_args(argv, world_size, prog="scripts/eval.py")
        if config.eval.dataset_path is None:
            raise ConfigError("eval.dataset_path is unset: point it at the held-out dataset")
        from torchtitan_rl.episodes import open_task

        opened = open_task(config)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    platform.patch_torchtitan()
    rank, world = platform.init_distributed()
    from torchtitan_rl import evaluation
    from torchtitan_rl.evaluation import build_evaluator
    from torchtitan_rl.generator.engine import LocalGenerator

    evaluator = build_evaluator(config, opened)
    # Seeded like the run's generator on this rank (colocated: job.seed + its engine, one per
    # rank or per generator.parallelism.tensor_parallel_degree ranks), and sharded alike.
    engine, engine_rank, engines = config.generator.parallelism.engine_of(rank, world)
    generator = LocalGenerator(
        generator=config.generator, model=config.model, seed=config.job.seed + engine
    )
    result = evaluator.run(generator, version=0, shard=engine, shards=engines)
    if engine_rank > 0:  # its engine's first rank counts the engine's evaluation
        result = result.counted_elsewhere()
    evaluation.all_reduce(result)
    if rank == 0:
        metrics = {k: v for k, v in result.metrics().items() if k != "eval/policy_version"}
        row = {
            "checkpoint": config.model.hf_checkpoint,
            "dataset": config.eval.dataset_path,
            "ranks": world,
            **metrics,
        }
        print(json.dumps(row), flush=True)
    generator.close()
    platform.shutdown_distributed()
    return 0


if __name__ == "__main__":
    platform.exit_process(main(sys.argv[1:]))
