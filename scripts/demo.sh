#!/usr/bin/env bash
# Set up, then run the CPU demo on 2 processes: the arithmetic demo (run_configs/arith_cpu.toml,
# about 6 minutes), or another config with CONFIG=..., e.g. the 25-second echo demo:
#   ./scripts/demo.sh --training.steps 20
#   CONFIG=run_configs/debug_cpu.toml ./scripts/demo.sh
# The console shows the steps, the evaluations and a summary; library output goes to
# {job.dump_folder}/run.log (add --job.verbose to see it here too).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
# torchrun sets 1 itself when this is unset, with a 5-line warning; the same value, said here.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec .venv/bin/torchrun --standalone --nproc_per_node 2 -m torchtitan_rl.train \
    --job.config_file "${CONFIG:-run_configs/arith_cpu.toml}" "$@"
