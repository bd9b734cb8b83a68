"""Building blocks of the GRPO loop, in process: the rollout batch, the echo task, the
batch-invariant logprob check. The loop end to end: tests/integration/test_rl_trainer.py.

    .venv/bin/python -m pytest tests/unit/test_rl_trainer.py
"""

import pytest
import torch

from torchtitan_rl.config import GeneratorParallelismSection
from torchtitan_rl.errors import EngineError
from torchtitan_rl.generator import engine_memory, engine_requests
from torchtitan_rl.tasks.toy import EchoDigitsTask
from torchtitan_rl.types import Completions, Prompt, Rollouts, Sample, rollout_batch


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


def test_the_ranks_of_a_tensor_parallel_engine_share_out_its_rollouts():
    """An engine over 2 ranks samples 4 prompts; each rank trains on 2 of them. The shares
    partition the groups in order, and the counts summed over ranks count them once."""
    prompts = [Prompt(text=str(i), answer="") for i in range(4)]
    samples = [[Sample([i, j], [-0.5, -0.5], "stop") for j in range(2)] for i in range(4)]
    rollouts = Rollouts(
        prompts,
        Completions([[i] for i in range(4)], samples),
        torch.arange(8.0).view(4, 2),
        rounds=3,
        generated_groups=9,
        short_groups=1,
        env_s=2.5,
        reward_parts_PN={"r": torch.ones(4, 2)},
    )
    first, second = rollouts.part(0, 2), rollouts.part(1, 2)
    assert [p.text for p in first.prompts] == ["0", "1"]
    assert [p.text for p in second.prompts] == ["2", "3"]
    assert torch.equal(second.rewards_PN, rollouts.rewards_PN[2:])
    assert second.completions.samples == samples[2:] and second.reward_parts_PN["r"].shape == (2, 2)
    joined = Rollouts.cat([first, second])
    assert torch.equal(joined.rewards_PN, rollouts.rewards_PN)
    counts = ("rounds", "parts", "generated_groups", "short_groups")
    assert [getattr(joined, c) for c in counts] == [3, 1, 9, 1]
    assert first.env_s == second.env_s == 2.5  # a time: each rank waited for it
    # Unset, the generated groups are the groups.
    assert Rollouts.cat([rollouts.part(i, 4) for i in range(4)]).generated == 9
    plain = Rollouts(prompts, rollouts.completions, rollouts.rewards_PN)
    assert plain.generated == 4 and sum(plain.part(i, 2).generated for i in range(2)) == 4


def test_engines_span_consecutive_ranks():
    parallelism = GeneratorParallelismSection(tensor_parallel_degree=2)
    layout = [parallelism.engine_of(rank, 4) for rank in range(4)]
    assert layout == [(0, 0, 2), (0, 1, 2), (1, 0, 2), (1, 1, 2)]
    alone = GeneratorParallelismSection()
    assert [alone.engine_of(rank, 2) for rank in range(2)] == [(0, 0, 2), (1, 0, 2)]


def test_a_tensor_parallel_engine_refuses_requests_that_differ_between_its_ranks(monkeypatch):
    """Its ranks must add the same requests (or they run different batches). The gather over
    vLLM's TP group is stood in for: here there is one process, no group."""
    from vllm import SamplingParams

    class Group:
        cpu_group = None

    digests = []

    def same_on_both(digest, group=None):
        digests.append(digest)
        return [digest, digest]

    monkeypatch.setattr("vllm.distributed.parallel_state.get_tp_group", lambda: Group())
    monkeypatch.setattr(engine_requests.platform, "all_gather_objects", same_on_both)

    def request(seed: int, prompt=(1, 2)):
        params = SamplingParams(seed=seed, max_tokens=4)
        return [("0", {"prompt_token_ids": list(prompt)}, params)]

    for requests in (request(3), request(3), request(4), request(3, (1, 3))):
        engine_requests._check_same_requests(requests)  # both ranks the same: no error
    assert digests[0] == digests[1] and len(set(digests)) == 3  # seed and prompt count

    def differ(digest, group=None):
        return [digest, digest + "x"]

    monkeypatch.setattr(engine_requests.platform, "all_gather_objects", differ)
    with pytest.raises(EngineError, match="rank 1 of its group differs from rank 0"):
        engine_requests._check_same_requests(request(3))


def test_stale_shared_memory_segments_are_removed_and_live_ones_kept():
    """A killed TP run leaves vLLM's CPU segments in /dev/shm under names the next run reuses:
    the next engine removes those no live process maps. Real files in /dev/shm; one mapped by
    this process stands for a running engine's."""
    import mmap

    stale = engine_memory.SHARED_MEMORY / "-tp:test-[0-1]-cpushm_0"
    live = engine_memory.SHARED_MEMORY / "-tp:test-[0-1]-cpushm_1"
    for segment in (stale, live):
        segment.write_bytes(b"\0" * mmap.PAGESIZE)
    with live.open("r+b") as f, mmap.mmap(f.fileno(), 0):
        try:
            removed = engine_memory.remove_stale_segments()
            assert stale in removed and not stale.exists()
            assert live not in removed and live.exists()
        finally:
            stale.unlink(missing_ok=True)
            live.unlink()
