"""The GRPO loop end to end (torchrun, real vLLM, real FSDP) and its building blocks.

.venv/bin/python -m pytest tests/test_rl_trainer.py
"""

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import run_dist, run_train

from torchtitan_rl.batch import rollout_batch
from torchtitan_rl.generator.engine import Sample
from torchtitan_rl.tasks.toy import EchoDigitsTask

REPO = Path(__file__).resolve().parents[1]
CONTRACT = [
    "step",
    "reward/mean",
    "reward/std",
    "response_length/mean",
    "loss",
    "entropy",
    "clip_fraction",
    "logprob_diff/max",
    "logprob_diff/mean",
    "policy_version",
    "time/generate_s",
    "time/train_s",
    "time/weight_sync_s",
    "weight_sync/bytes",
    "time/step_s",
    "throughput/generated_tokens_per_s",
]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    dump = tmp_path_factory.mktemp("demo")
    result = run_train(
        "--job.config_file",
        "run_configs/debug_cpu.toml",
        "--training.steps",
        "5",
        "--job.dump_folder",
        str(dump),
        nproc=2,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return dump, rows, result.stdout


def test_metrics_follow_the_contract(demo):
    _, rows, _ = demo
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    for row in rows:
        assert set(CONTRACT) <= set(row), set(CONTRACT) - set(row)
        assert all(math.isfinite(row[k]) for k in CONTRACT)
        assert 0.0 <= row["reward/mean"] <= 1.0
        assert row["response_length/mean"] > 0
        assert row["time/step_s"] >= row["time/generate_s"] + row["time/train_s"]


def test_policy_version_increments_every_step(demo):
    _, rows, _ = demo
    assert [r["policy_version"] for r in rows] == [1.0, 2.0, 3.0, 4.0, 5.0]


def test_generator_and_trainer_agree_before_each_update(demo):
    _, rows, _ = demo
    assert all(r["logprob_diff/max"] <= 1e-5 for r in rows)


def test_tensor_parallel_loop_takes_the_same_steps_as_fsdp(demo, tmp_path):
    """TP=2 on the 2 ranks: each rank samples its own share of the prompts (as under FSDP=2),
    the TP group trains on their union, and weight sync gathers the TP shards. Same prompts,
    seeds and starting weights as the FSDP=2 demo, so the same samples and the same update."""
    result = run_train(
        *("--job.config_file", "run_configs/debug_cpu.toml", "--training.steps", "2"),
        *("--parallelism.tp", "2", "--job.dump_folder", str(tmp_path)),
        nproc=2,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    tp_rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    fsdp_rows = demo[1]
    first, fsdp_first = tp_rows[0], fsdp_rows[0]
    for key in ("reward/mean", "response_length/mean", "generated_tokens"):
        assert first[key] == fsdp_first[key], key
    for key in ("grad_norm", "entropy"):
        assert first[key] == pytest.approx(fsdp_first[key], rel=1e-4), key
    # seq_mean_token_mean at ratio 1: each group's advantages sum to 0, so the loss is 0 up to
    # rounding on both layouts.
    assert first["loss"] == pytest.approx(fsdp_first["loss"], abs=1e-7)
    # The synced weights are the TP policy's: the generator agrees with it after the step.
    assert tp_rows[1]["logprob_diff/max"] <= 1e-5
    assert tp_rows[1]["policy_version"] == 2.0


def test_sleep_mode_changes_no_figure_of_the_run(demo, tmp_path):
    """Freeing the generator's weights during training and re-allocating them for the sync
    leaves the run exactly as it was: same rewards, losses and generator/trainer agreement."""
    result = run_train(
        *("--job.config_file", "run_configs/debug_cpu.toml", "--training.steps", "2"),
        *("--generator.enable_sleep_mode", "true", "--job.dump_folder", str(tmp_path)),
        nproc=2,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for row, awake in zip(rows, demo[1][:2], strict=True):
        for key in ("reward/mean", "response_length/mean", "loss", "grad_norm"):
            assert row[key] == awake[key], key
        assert row["logprob_diff/max"] <= 1e-5


def test_run_writes_its_files_and_a_line_per_step(demo):
    dump, _, stdout = demo
    assert (dump / "config.toml").is_file()
    assert (dump / "reward_curve.png").stat().st_size > 1000
    lines = stdout.splitlines()
    assert sum(line.startswith("step ") for line in lines) == 5 and "reward " in stdout
    assert any(line.startswith("done: trained to step 5 in ") for line in lines)


@pytest.mark.parametrize(
    "placement, nproc", [("colocated", 0), ("disaggregated", 2)], ids=["colocated", "disaggregated"]
)
def test_hooks_fire_in_order_and_kl_grows_from_zero(placement, nproc, tmp_path):
    # Colocated with sleep mode: the generator's weights are freed while the trainer trains.
    sleep = ["--generator.enable_sleep_mode", "true"] if placement == "colocated" else []
    run_dist(
        "rl_hooks_run.py", str(tmp_path), "--generator.placement", placement, *sleep, nproc=nproc
    )
    calls = json.loads((tmp_path / "hooks.json").read_text())
    assert [c[:2] for c in calls] == [
        [name, step]
        for step in (1, 2)
        for name in ("before_step", "after_train", "after_sync", "after_step")
    ]
    assert "loss" in calls[1][2] and calls[2][2] == 1 and calls[7][2] == 2.0
    # KL to the frozen reference: 0 while the policy is the reference, > 0 once step 1 (whose
    # 256 samples include some rewarded ones) has moved the policy.
    assert calls[3][3] == 0.0 and calls[7][3] > 0
    if placement == "colocated":
        # One forward of the policy per step (the pre-update logprobs come from the training
        # forward, no extra scoring pass) and one of the reference.
        forwards = json.loads((tmp_path / "forwards.json").read_text())
        assert forwards == [{"policy": 1, "reference": 1}] * 2
        assert json.loads((tmp_path / "generator_numel.json").read_text()) == [0, 0]


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
    from torchtitan_rl.batch import RolloutBatch
    from torchtitan_rl.rl_trainer import InvarianceError, RLTrainer

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
        rl = SimpleNamespace(
            group=None,
            rank=0,
            config=SimpleNamespace(batch_invariant_on_mismatch=on_mismatch),
            loss=SimpleNamespace(correction=OffPolicyCorrection()),
        )
        rl.invariance_broken = lambda *args: RLTrainer.invariance_broken(rl, *args)
        return lambda trainer: RLTrainer.logprob_diff(rl, 7, batch, trainer)

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
