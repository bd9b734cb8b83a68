#!/usr/bin/env bash
# Set up, then run the test suite: both tiers, or the unit tier alone (tests/README.md).
#   ./scripts/test.sh [--fast] [pytest arguments]
#   --fast: tests/unit only (in-process, no torchrun world, no engine; under 2 minutes)
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
if [ "${1:-}" = "--fast" ]; then
    shift
    exec .venv/bin/python -m pytest tests/unit "$@"
fi
exec .venv/bin/python -m pytest "$@"
