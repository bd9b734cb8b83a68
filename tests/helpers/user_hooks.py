"""Hooks classes that tests name as job.hooks (with tests/helpers on PYTHONPATH): faults
injected on one rank at one point of the loop (tests/integration/test_long_runs.py)."""

import os
import time

from torchtitan_rl.loop import Hooks

FAULT_STEP = 2


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


class HangsInTrainOnRank1(Hooks):
    """Rank 1 stops at the end of step 2's train phase (before its weight sync), for good."""

    def __init__(self, config):
        pass

    def after_train(self, step, metrics):
        if _rank() == 1 and step == FAULT_STEP:
            time.sleep(3600)


class EngineRaisesOnRank1(Hooks):
    """From step 2 on, rank 1's vLLM engine raises inside its step (the real LLMEngine, with
    one method replaced)."""

    def __init__(self, config):
        pass

    def before_step(self, step):
        if _rank() == 1 and step == FAULT_STEP:
            from vllm import LLMEngine

            def step_raises(engine):
                raise RuntimeError("injected fault: the KV cache is corrupt")

            LLMEngine.step = step_raises
