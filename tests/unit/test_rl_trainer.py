"""Building blocks of the GRPO loop, in process: the rollout batch, the echo task, the
batch-invariant logprob check. The loop end to end: tests/integration/test_rl_trainer.py.

    .venv/bin/python -m pytest tests/unit/test_rl_trainer.py
"""

import pytest
import torch

from torchtitan_rl.tasks.toy import EchoDigitsTask
from torchtitan_rl.types import Sample, rollout_batch


def test_rollout_batch_masks_sampled_tokens_and_aligns_logprobs():
    batch = rollout_batch(
        prompts=[[5, 6], [7]],
        samples=[
            [Sample([8, 1], [-0.1, -0.2], "stop"), Sample([9], [-0.3], "length")],
            # An episode: a sampled turn, the environment's reply (13, 14), a sampled turn.
            [
                Sample(
                    [10, 1, 13, 14, 11, 1],
                    [-0.4, -0.5, 0, 0, -0.6, -0.8],
                    "stop",
                    [1, 1, 0, 0, 1, 1],
                ),
                Sample([12], [-0.7], "length"),
            ],
        ],
        advantages_PN=torch.tensor([[1.0, -1.0], [0.5, -0.5]]),
        pad_id=0,
    )
    assert batch.tokens_BT.tolist() == [
        [5, 6, 8, 1, 0, 0, 0],
        [5, 6, 9, 0, 0, 0, 0],
        [7, 10, 1, 13, 14, 11, 1],
        [7, 12, 0, 0, 0, 0, 0],
    ]
    assert batch.loss_mask_BT.tolist() == [
        [0, 0, 1, 1, 0, 0, 0],
        [0, 0, 1, 0, 0, 0, 0],
        [0, 1, 1, 0, 0, 1, 1],
        [0, 1, 0, 0, 0, 0, 0],
    ]
    assert batch.generator_logprobs_BT[2].tolist() == pytest.approx(
        [0.0, -0.4, -0.5, 0.0, 0.0, -0.6, -0.8]
    )
    assert batch.advantages_B.tolist() == [1.0, -1.0, 0.5, -0.5]


def test_echo_task_prompts_are_deterministic_and_rewards_dense():
    task = EchoDigitsTask(num_digits=3, seed=1)
    assert task.prompts(7, 4) == task.prompts(7, 4) != task.prompts(8, 4)
    prompt = task.prompts(7, 1)[0]
    assert prompt.text == f"echo {prompt.answer}:" and len(prompt.answer) == 3
    assert task.reward(prompt, prompt.answer) == 1.0
    assert task.reward(prompt, prompt.answer[:2]) == pytest.approx(2 / 3)
    assert task.reward(prompt, "") == 0.0


def test_batch_invariant_mode_stops_or_warns_on_a_logprob_difference(monkeypatch, capsys):
    from types import SimpleNamespace

    from torchtitan_rl import batch_invariant, platform
    from torchtitan_rl.algorithms.offpolicy import OffPolicyCorrection
    from torchtitan_rl.learner import InvarianceError, Learner
    from torchtitan_rl.types import RolloutBatch

    platform.init_distributed()  # a world of one
    monkeypatch.setattr(batch_invariant, "_enabled", True)
    generator_BT = torch.tensor([[0.0, -0.5, -1.25, 0.0], [0.0, -2.0, -0.75, -0.1]])
    batch = RolloutBatch(
        tokens_BT=torch.zeros(2, 4, dtype=torch.long),
        loss_mask_BT=torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.0, 1.0, 1.0, 1.0]]),
        advantages_B=torch.zeros(2),
        generator_logprobs_BT=generator_BT,
    )
    trainer_BT = generator_BT.clone()
    trainer_BT[1, 2] = torch.nextafter(trainer_BT[1, 2], torch.tensor(0.0))  # one ulp

    def run(on_mismatch: str):
        learner = SimpleNamespace(
            group=None,
            config=SimpleNamespace(batch_invariant_on_mismatch=on_mismatch),
            loss=SimpleNamespace(correction=OffPolicyCorrection()),
        )
        learner.invariance_broken = lambda *args: Learner.invariance_broken(learner, *args)
        return lambda trainer: Learner.logprob_diff(learner, 7, batch, trainer)

    assert run("fail")(generator_BT.clone())["logprob_diff/max"] == 0.0  # equal: no complaint
    with pytest.raises(InvarianceError) as error:
        run("fail")(trainer_BT)
    assert str(error.value).startswith(
        "step 7: batch_invariant = true but trainer and generator logprobs differ "
        "(logprob_diff/max = 5.96e-08, first on rank 0, sequence 1, token 2: "
        "trainer -0.7499999403953552, generator -0.75)"
    )
    metrics = run("warn")(trainer_BT)
    assert metrics["logprob_diff/max"] == pytest.approx(5.96e-8, rel=1e-3)
    assert "warning: step 7: batch_invariant = true" in capsys.readouterr().out
    monkeypatch.setattr(batch_invariant, "_enabled", False)
    assert run("fail")(trainer_BT)["logprob_diff/max"] > 0  # mode off: the metric only
