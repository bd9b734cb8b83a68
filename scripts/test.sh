#!/usr/bin/env bash
# Set up, then run the whole test suite (every test runs; the slowest are listed at the end).
#   ./scripts/test.sh [pytest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
