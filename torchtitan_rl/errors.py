"""What stops a run with one line: `StopRun` and its kinds, each raised where it is found.

    .venv/bin/python -m pytest tests/unit/test_faults.py

The launcher (torchtitan_rl/launch.py) catches `StopRun`, prints its one line and exits 1;
`ConfigError` (torchtitan_rl/config) exits 2. Anything else is a crash and shows its traceback.
"""


class StopRun(RuntimeError):
    """A run cannot go on: a non-finite value, a failing reward function, a bad weight copy,
    a failed checkpoint save, broken batch invariance. The message says which and why."""


class EngineError(StopRun):
    """The generator's engine failed: an exception inside vLLM, or its process died. The
    message names the step and the engine's error; its traceback goes to the run log."""
