#!/usr/bin/env bash
# Set up, then run the CPU demo on 2 processes. Extra arguments override the config, e.g.
#   ./scripts/demo.sh --training.steps 20
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/torchrun --standalone --nproc_per_node 2 -m torchtitan_rl.train \
    --job.config_file run_configs/debug_cpu.toml "$@"
