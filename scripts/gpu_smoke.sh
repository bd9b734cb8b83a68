#!/usr/bin/env bash
# The first thing to run on a machine with one GPU (CUDA torch, torchtitan, optionally vLLM's
# CUDA build): the trainer side on the GPU, then 3 colocated steps if vLLM is there; one JSON
# line. Not run in CI (no GPU there).
#   scripts/gpu_smoke.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
[ -d assets/tiny_qwen3 ] || "$PYTHON" scripts/make_tiny_checkpoint.py --model qwen3 --out assets/tiny_qwen3
exec "$PYTHON" scripts/gpu_smoke.py
