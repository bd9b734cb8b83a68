"""Entry point of a run: parse the config, join the torchrun world, build, train.

    torchrun --nproc_per_node 2 -m torchtitan_rl.train --job.config_file run_configs/debug_cpu.toml
    python -m torchtitan_rl.train --job.config_file run_configs/debug_cpu.toml --job.dry_run

Config errors exit with code 2 and one line on stderr. Until the RL loop lands, a real run
builds the FSDP-sharded policy on every rank, loads the HF checkpoint, scores one prompt and
checks that all ranks agree, then stops.
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from torchtitan_rl import platform
from torchtitan_rl.config import ConfigError, JobConfig, parse_args, to_toml
from torchtitan_rl.config.manager import write_config


def smoke_run(config: JobConfig, rank: int, world_size: int) -> None:
    """Build the sharded policy, score one prompt, and check every rank got the same logprob."""
    from tokenizers import Tokenizer

    from torchtitan_rl.trainer.policy_trainer import PolicyTrainer

    trainer = PolicyTrainer(
        model=config.model,
        training=config.training,
        parallelism=config.parallelism,
        temperature=config.generator.sampling.temperature,
        seed=config.job.seed,
        dump_folder=config.job.dump_folder,
    )
    tokenizer_dir = config.model.tokenizer_path or config.model.hf_checkpoint
    tokenizer = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    logprobs_BT, _ = trainer.logprobs(torch.tensor([tokenizer.encode("echo 123: 123").ids]))
    total = logprobs_BT.sum()
    gathered = [torch.zeros_like(total) for _ in range(world_size)]
    dist.all_gather(gathered, total)
    if any(not torch.equal(g, total) for g in gathered):
        raise RuntimeError(f"ranks disagree on the prompt logprob: {gathered}")
    if rank == 0:
        n_params = sum(p.numel() for p in trainer.model.parameters())
        print(
            f"built {config.model.name}/{config.model.flavor} sharded over {world_size} rank(s) "
            f"({n_params:,} parameters); prompt logprob {total.item():.6f} agrees on "
            "every rank",
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    try:
        config = parse_args(argv, world_size)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if config.job.dry_run:
        if rank == 0:
            print(to_toml(config), end="")
        return 0

    platform.patch_torchtitan()
    rank, world_size = platform.init_distributed()
    try:
        if rank == 0:
            write_config(config, Path(config.job.dump_folder) / "config.toml")
        smoke_run(config, rank, world_size)
    except ConfigError as e:
        # Every rank meets the same config error; torchrun collects the exit codes.
        print(f"error: {e}", file=sys.stderr)
        return 2
    platform.shutdown_distributed()
    return 0


if __name__ == "__main__":
    platform.exit_process(main())
