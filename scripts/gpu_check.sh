#!/usr/bin/env bash
# The CUDA-only parts checked with torch alone, on a lent GPU machine (torch, no vLLM; torchtitan
# not needed): varlen packed attention, the chunked LM head's memory at 16k tokens, the
# batch-invariant kernels, the cpu:gloo,cuda:nccl process group; then a torchtitan MoE decoder
# layer captured and replayed as CUDA graphs (scripts/gpu_graph_check.py: torchtitan's wheels,
# scripts/gpu_wheels.sh, and on torch 2.11 scripts/gpu_shim on PYTHONPATH). One JSON line each.
# docs/cuda_contracts.md says what each figure checks. Not run in CI (no GPU there).
#   scripts/gpu_check.sh            (PYTHON=... picks the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
timeout 480 "$PYTHON" scripts/gpu_check.py "$@"
exec timeout 240 "$PYTHON" scripts/gpu_graph_check.py "$@"
