"""Train with the given flags, then greedy-generate with the run's own generator.

    torchrun --standalone --nproc_per_node 2 tests/dist/train_then_greedy.py PROMPT MAX_TOKENS \
        --job.config_file run_configs/debug_cpu.toml ...

Rank 0 writes {job.dump_folder}/greedy.json: the token ids the generator holding the final
weights picks greedily for PROMPT.
"""

import json
import sys
from pathlib import Path

from tokenizers import Tokenizer

from torchtitan_rl import platform
from torchtitan_rl.config import parse_args
from torchtitan_rl.rl_trainer import RLTrainer


def main() -> None:
    prompt, max_tokens, flags = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    platform.patch_torchtitan()
    rank, world_size = platform.init_distributed()
    config = parse_args(flags, world_size)
    run = RLTrainer(config)
    run.train()
    tokenizer = Tokenizer.from_file(str(Path(config.model.tokenizer_dir) / "tokenizer.json"))
    completions = run.generator.generate(
        [tokenizer.encode(prompt).ids], n=1, temperature=0.0, max_tokens=max_tokens
    )
    if rank == 0:
        tokens = completions.samples[0][0].token_ids
        (Path(config.job.dump_folder) / "greedy.json").write_text(json.dumps(tokens))
    platform.shutdown_distributed()


if __name__ == "__main__":
    main()
    platform.exit_process(0)
