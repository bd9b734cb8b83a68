"""The algorithm registry: each advantage estimator is one module of algorithms/advantages/,
each policy loss one module of algorithms/losses/, and its file name is its config value.

    .venv/bin/python -m pytest tests/unit/test_algorithms.py

Adding one is one file and its test: `config/algorithm.py`'s choices are the file names
(read here without importing them, so the config stays free of torch). An advantage module
defines `ESTIMATOR` (rewards [P, N] -> advantages [P, N]) and `COMPARES_GROUP` (whether it needs
n >= 2 samples per prompt); a loss module defines `PRESET` (what it sets of the [algorithm]
fields left unset) and `build(algorithm, max_tokens, teacher_coef)`, whose loss declares the
figures it reports (`PolicyLoss.TOKEN_METRICS`).
"""

import importlib
from pathlib import Path
from types import ModuleType

PACKAGES = {"advantage": "advantages", "loss": "losses"}


def names(kind: str) -> tuple[str, ...]:
    """The registered names of `kind` (advantage or loss): its package's module files."""
    folder = Path(__file__).parent / PACKAGES[kind]
    return tuple(sorted(p.stem for p in folder.glob("*.py") if not p.stem.startswith("_")))


def load(kind: str, name: str) -> ModuleType:
    """The module of the `kind` named `name`."""
    return importlib.import_module(f"torchtitan_rl.algorithms.{PACKAGES[kind]}.{name}")
