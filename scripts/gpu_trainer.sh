#!/usr/bin/env bash
# The trainer at GPU speed, on one GPU: ours (optimizer_step) against the plain torchtitan step
# at Qwen3 0.6B, 1.7B and 4B in bf16 (random weights, micro_batch_tokens 16,384), on uniform
# and on long-tailed rows, each case one JSON line of scripts/bench/trainer.py: tokens/s,
# `ratio` = ours / plain, `mfu` of each (torchtitan's FLOPs per token over --peak_tflops, 989 by
# default: H100/H200 SXM bf16 dense), `peak_device_gib` and `host_syncs` of each (CUDA's sync
# debug mode, one warning per wait). Sized for under 8 minutes eager on an H200 (each case
# stops at CASE_TIMEOUT = 150 s); --compile adds training.compile to both sides and a first
# compile to each case (raise CASE_TIMEOUT, or run fewer CASES). Not run in CI (no GPU).
#   scripts/gpu_trainer.sh [--compile] [--peak_tflops T]       (PYTHON=... picks the interpreter)
# On a lent machine with torch alone: scripts/gpu_wheels.sh here first, carry .whl; they are
# installed to /tmp/site and scripts/gpu_shim makes torchtitan 0.3.0 run on torch 2.11.
# Logs: $LOGS (default $OUT or /tmp), gpu_trainer_<case>.log.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
LOGS=${LOGS:-${OUT:-/tmp}}
if ! "$PYTHON" -c "import torchtitan" 2>/dev/null; then
    [ -d .whl ] || { echo "no torchtitan and no .whl: run scripts/gpu_wheels.sh first" >&2; exit 2; }
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD/scripts/gpu_shim:$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1

# "flavor, uniform rows of $SEQ tokens, long-tailed sequences" per case (the long tail's ~30k
# tokens at 0.6B, as the uniform rows'); CASES, SEQ and MAX_COMPLETION override them (e.g. a
# CPU check of this script: CASES="tiny 4 8" SEQ=256 MAX_COMPLETION=256).
CASES=${CASES:-"0.6B 16 48;1.7B 8 24;4B 4 12"}
SEQ=${SEQ:-2048}
MAX_COMPLETION=${MAX_COMPLETION:-2048}
CASE_TIMEOUT=${CASE_TIMEOUT:-150}
BENCH=(-m torch.distributed.run --standalone --nproc_per_node 1 scripts/bench/trainer.py
    --dtype bfloat16 --budget 16384 --steps 3 --warmup 2)
IFS=';' read -ra cases <<<"$CASES"
for case in "${cases[@]}"; do
    read -r flavor rows sequences <<<"$case"
    for lengths in uniform longtail; do
        if [ "$lengths" = uniform ]; then
            shape=(--batch "$rows" --seq "$SEQ")
        else
            shape=(--lengths longtail --compare plain --sequences "$sequences"
                --max_completion "$MAX_COMPLETION")
        fi
        log="$LOGS/gpu_trainer_${flavor}_${lengths}.log"
        # A case may not take the others' time: stopped at CASE_TIMEOUT s, it prints why.
        if timeout "$CASE_TIMEOUT" "$PYTHON" "${BENCH[@]}" --flavor "$flavor" "${shape[@]}" "$@" \
            >"$log" 2>&1; then
            grep '^{' "$log" | tail -1 || true
        else
            status=$?
            echo "{\"bench\": \"trainer\", \"flavor\": \"$flavor\", \"lengths\": \"$lengths\", \"failed\": \"exit $status, see $log\"}"
            tail -5 "$log" >&2
        fi
    done
done
