#!/usr/bin/env bash
# The wheels a lent GPU machine (Python 3.12, torch 2.11, no network, no torchtitan) needs to run
# scripts/gpu_graph_check.py and scripts/bench/trainer.py (scripts/gpu_trainer.sh installs them
# itself), written to .whl/ (ignored by git) at the versions of this checkout's .venv. On the
# machine, with .whl carried:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   PYTHONPATH=$PWD/scripts/gpu_shim:/tmp/site:$PWD python3 scripts/gpu_graph_check.py
# scripts/gpu_shim/sitecustomize.py lets torchtitan 0.3.0 import on torch 2.11 (docs/cuda_contracts.md).
set -euo pipefail
cd "$(dirname "$0")/.."
for name in torchtitan tyro docstring-parser typeguard spmd-types tomli-w torchdata datasets \
    dill multiprocess; do
    version=$(.venv/bin/pip show "$name" | sed -n 's/^Version: //p')
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp -d .whl "$name==$version"
done
du -sh .whl
