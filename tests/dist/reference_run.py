"""The entry point of an RL run (torchtitan_rl.train.main: console, run.log, summary), whose
trainer, once trained, also has its generator pick tokens greedily.

    torchrun --standalone --nproc_per_node 2 tests/dist/reference_run.py PROMPT MAX_TOKENS \
        --job.config_file run_configs/debug_cpu.toml ...

Rank 0 writes {job.dump_folder}/greedy.json: the token ids the generator holding the final
weights picks greedily for PROMPT. Everything else is what `python -m torchtitan_rl.train`
does with the same flags.
"""

import json
import sys
from pathlib import Path

from tokenizers import Tokenizer

from torchtitan_rl import platform, train
from torchtitan_rl.placements.colocated import RLTrainer


def main() -> int:
    prompt, max_tokens, flags = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    train_only = RLTrainer.train

    def train_then_greedy(run: RLTrainer) -> None:
        train_only(run)
        config = run.config
        tokenizer = Tokenizer.from_file(str(Path(config.model.tokenizer_dir) / "tokenizer.json"))
        completions = run.generator.generate(
            [tokenizer.encode(prompt).ids], n=1, temperature=0.0, max_tokens=max_tokens
        )
        if run.rank == 0:
            tokens = completions.samples[0][0].token_ids
            (Path(config.job.dump_folder) / "greedy.json").write_text(json.dumps(tokens))

    RLTrainer.train = train_then_greedy
    return train.main(flags)


if __name__ == "__main__":
    platform.exit_process(main())
