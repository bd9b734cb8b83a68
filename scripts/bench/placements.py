"""Compare the placements on one workload, on the same cores: colocated (every rank generates,
then trains), disaggregated k = 1 (1 trainer rank + 1 generator rank, whole steps) and
continuous k = 1 (1 + 1, groups streamed, weights updated in flight). One JSON line.

    .venv/bin/python scripts/bench/placements.py --job.config_file run_configs/debug_cpu.toml \
        --model.hf_checkpoint assets/debug_qwen3_L100 --model.flavor debugmodel \
        --training.prompts_per_step 8 --generator.sampling.n 8 \
        --generator.sampling.max_tokens 512 --generator.max_model_len 640 \
        --training.steps 5 --training.lr 1e-7

Each placement runs the flags under `torchrun --nproc_per_node 2` (scripts/bench/e2e.py, which
times steps 2..N). Figures per placement: `trained_tokens_per_s` (completion tokens trained per
second of wall time), `step_s`, each side's busy fraction, and the completion lengths (which
must agree between placements for the comparison to hold); then the ratios of continuous's
tokens per second to the others'.
"""

import json
import sys

from e2e import run

OFF_POLICY = ("--algorithm.max_offpolicy_steps", "1")
PLACEMENTS = {
    "colocated": (),
    "disaggregated": ("--generator.placement", "disaggregated", *OFF_POLICY),
    "continuous": ("--generator.placement", "continuous", *OFF_POLICY),
}
KEYS = (
    "trained_tokens_per_s",
    "step_s",
    "generate_s",
    "train_s",
    "trainer_busy",
    "generator_busy",
    "response_length_mean",
    "response_length_max",
    "peak_rss_gib_per_rank",
    "peak_rss_gib_children_per_rank",
)
SHAPE = ("model_path", "prompts_per_step", "group_size", "max_tokens", "steps")


def main() -> int:
    flags = sys.argv[1:]
    result = {"bench": "placements"}
    for name, extra in PLACEMENTS.items():
        figures = run(2, [*flags, *extra])
        result[name] = {key: figures[key] for key in KEYS}
    result["shape"] = {key: figures[key] for key in SHAPE}
    tokens = {name: result[name]["trained_tokens_per_s"] for name in PLACEMENTS}
    result["continuous_vs_disaggregated"] = round(tokens["continuous"] / tokens["disaggregated"], 3)
    result["continuous_vs_colocated"] = round(tokens["continuous"] / tokens["colocated"], 3)
    result["fastest"] = max(tokens, key=tokens.get)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
