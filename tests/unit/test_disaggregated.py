"""Disaggregated placement, in process: a rollout older than algorithm.max_offpolicy_steps is
refused. Real runs: tests/integration/test_disaggregated.py.

    .venv/bin/python -m pytest tests/unit/test_disaggregated.py
"""

from types import SimpleNamespace

import pytest
import torch

from torchtitan_rl.config import parse_args
from torchtitan_rl.placements import disaggregated
from torchtitan_rl.placements.disaggregated import DisaggregatedTrainer, StalenessError
from torchtitan_rl.types import Completions, Rollout, Rollouts


def test_a_rollout_older_than_k_is_refused(monkeypatch):
    config = parse_args(["--job.config_file", "run_configs/debug_cpu.toml"])
    stale = Rollout(
        step=7,
        version=3,
        weights_sha256=None,
        rollouts=Rollouts([], Completions(prompts=[], samples=[]), torch.zeros(0, 2)),
        reward_errors=0,
        generate_s=0.0,
        evaluations=[],
    )
    monkeypatch.setattr(disaggregated, "_receive", lambda src: stale)
    trainer = SimpleNamespace(sources=[1], config=config)
    message = "step 7: got the rollout of step 7, sampled with policy version 3, 3 versions old"
    with pytest.raises(StalenessError, match=message):
        DisaggregatedTrainer.receive(trainer, 7)
