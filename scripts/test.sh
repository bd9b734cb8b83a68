#!/usr/bin/env bash
# Set up, then run the test suite: both tiers, or the unit tier alone (tests/README.md).
#   ./scripts/test.sh [--fast] [pytest arguments]
#   --fast: tests/unit only (no torchrun world, no engine; under a minute)
# Two pytest-xdist workers: a torchrun world keeps 2 cores busy only about two thirds of its
# time (engine starts, imports, collectives), so a second test fills the rest. The tests that
# share a run stay on one worker (tests/conftest.py). `-n 0` runs in this process.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
if [ "${1:-}" = "--fast" ]; then
    shift
    # On two workers too: 47 s against 61 s in one process (12 s of it collection).
    exec .venv/bin/python -m pytest -n 2 --dist loadgroup tests/unit "$@"
fi
./scripts/setup_verifiers.sh  # the verifiers adapter's test (tests/integration/test_gateway.py)
exec .venv/bin/python -m pytest -n 2 --dist loadgroup "$@"
