"""Every advantage x loss x mini-batches x KL combination, and the off-policy corrections,
through the real colocated loop (2 ranks, the tiny model, vLLM), three steps each.

    .venv/bin/python -m pytest tests/integration/test_algorithm_matrix.py
"""

import json
import math

import pytest
from helpers.launch import run_dist


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    out = tmp_path_factory.mktemp("matrix")
    run_dist("algorithm_matrix_run.py", str(out), nproc=2)
    return json.loads((out / "matrix.json").read_text())


def test_every_combination_trains_with_finite_metrics(matrix):
    assert len(matrix) == 3 * 3 * 2 * 2 + 10
    for row in matrix:
        combination, metrics = row["combination"], row["metrics"]
        bad = {k: v for k, v in metrics.items() if not math.isfinite(v)}
        assert not bad, (combination, bad)
        if combination.get("overlong") != "zero_reward":  # see the overlong test below
            assert row["moved"], combination  # every rank's weights changed
        mini_batches = combination.get("mini_batches", 1)
        epochs = combination.get("epochs", 1)
        assert metrics["optimizer_steps"] == mini_batches * epochs, combination
        if mini_batches * epochs > 1:
            # After the first optimizer step the ratio leaves 1 and the clip acts.
            assert sum(row["clip_fractions"]) > 0, combination
        else:
            # One update per batch: the ratio is exactly 1, nothing is clipped.
            assert row["clip_fractions"] == [0.0] * 3, combination
        if combination.get("kl_beta", 0) > 0:
            assert metrics["kl"] > 0, combination  # the policy has left the reference
        else:
            assert "kl" not in metrics, combination


def test_dapo_samples_dynamically_and_others_do_not(matrix):
    for row in matrix:
        dynamic = row["combination"].get("loss") == "dapo"
        assert ("dynamic_sampling/rounds" in row["metrics"]) == dynamic, row["combination"]
        if dynamic:
            assert 1 <= row["metrics"]["dynamic_sampling/rounds"] <= 4


def test_offpolicy_corrections_act_on_a_lagging_generator(matrix):
    """The corrections' rows sample from a generator two updates behind by the last step
    (algorithm_matrix_run.Lagging), in the bands [0, 2] (tis) and [0.5, 2] (mis):
    step 1 is on-policy (ratios within numerics of 1, nothing corrected); by step 3 some units
    lie outside the band, the correction changes them, and no weight exceeds the cap."""
    corrected = [row for row in matrix if "offpolicy_correction" in row["combination"]]
    assert len(corrected) == 4
    for row in corrected:
        combination, steps = row["combination"], row["offpolicy_steps"]
        mode, cap = combination["offpolicy_correction"], combination["offpolicy_ratio_max"]
        fraction = f"offpolicy/{'truncated' if mode == 'tis' else 'masked'}_fraction"
        first, last = steps[0], steps[-1]
        assert first[fraction] == 0.0, combination
        assert 0.999 < first["offpolicy/ratio_min"] <= first["offpolicy/ratio_max"] < 1.001
        assert last[fraction] > 0, (combination, last)
        assert last["offpolicy/kl"] > first["offpolicy/kl"], (combination, steps)
        outside = last["offpolicy/ratio_max"] > cap or (
            mode == "mis" and last["offpolicy/ratio_min"] < combination["offpolicy_ratio_min"]
        )
        assert outside, (combination, last)
        # What the loss saw: clipped to the cap (tis), or dropped outside the band (mis).
        assert last["offpolicy/weight_max"] <= cap, (combination, last)


def test_overlong_shaping_changes_the_rewards_the_advantages_see(matrix):
    rows = {row["combination"].get("overlong"): row for row in matrix}
    shaped = {mode: row["metrics"] for mode, row in rows.items()}
    for mode in ("zero_reward", "soft_penalty"):
        metrics = shaped[mode]
        # The random tiny model rarely stops within max_tokens = 2.
        assert metrics["response/truncated_fraction"] > 0.5, metrics
    zeroed = shaped["zero_reward"]
    assert zeroed["reward/shaped_mean"] <= zeroed["reward/mean"]
    # The random model's few rewarded samples are the truncated ones: with their rewards
    # zeroed there is no signal, and no weight moves; any reward left moves them.
    assert rows["zero_reward"]["moved"] == (zeroed["reward/shaped_mean"] > 0)
    # Every 2-token sample loses 1, and every truncated sample has 2 tokens.
    penalized = shaped["soft_penalty"]
    fraction = penalized["response/truncated_fraction"]
    assert penalized["reward/shaped_mean"] <= penalized["reward/mean"] - fraction + 1e-6
    assert "reward/shaped_mean" not in shaped[None]


def test_a_distill_teacher_in_either_mode_joins_the_reward(matrix):
    """The teacher is the starting checkpoint; three steps at lr 5e-3 take the student away
    from it. Mode advantage adds the per-token advantages (their size logged beside the
    reward's); mode loss adds the KL term (`distill/kl`, declared by the loss)."""
    rows = {row["combination"].get("distill_mode"): row for row in matrix}
    for mode in ("advantage", "loss"):
        metrics = rows[mode]["metrics"]
        assert rows[mode]["moved"], mode
        assert metrics["distill/reverse_kl"] != 0 and metrics["distill/teacher_logprob"] < 0
        assert ("distill/kl" in metrics) == (mode == "loss")
        assert ("distill/advantage_teacher" in metrics) == (mode == "advantage")
    assert rows["loss"]["metrics"]["distill/kl"] > 0
    advantage = rows["advantage"]["metrics"]
    assert advantage["distill/advantage_teacher"] > 0
    # Logged beside it, the reward's: often 0 here (the random model's groups mostly all fail).
    assert advantage["distill/advantage_reward"] >= 0
    assert not any(k.startswith("distill/") for k in rows[None]["metrics"])
