"""Faults: NaN rewards, a generator short of KV cache, long seeded steps, a checkpoint write
that fails. User rewards that raise, in a real run: test_mixture.py.

    .venv/bin/python -m pytest tests/integration/test_faults.py

Real runs: torchrun with 2 ranks, the real vLLM engine. A rank killed mid-step:
test_resume.py; a NaN/inf loss or gradient: tests/unit/test_model.py
(test_non_finite_step_stops_without_touching_weights).
"""

import json
import os
import subprocess
import sys

import psutil
from helpers.launch import (
    HELPERS,
    REPO,
    kill_tree,
    logged_steps,
    run_dist,
    run_train,
    wait_for_step,
)

from torchtitan_rl.checkpoint import invalid_reason

RUN = (
    "--job.config_file",
    "run_configs/debug_cpu.toml",
    "--training.steps",
    "6",
    "--checkpoint.enable",
    "true",
    "--checkpoint.interval",
    "2",
)


def test_a_nan_reward_stops_the_run_and_keeps_the_last_checkpoint(tmp_path):
    result = run_train(
        *RUN,
        "--task.reward_fn",
        "user_rewards:nan_from_step_3",
        "--job.dump_folder",
        str(tmp_path),
        nproc=2,
        env={"PYTHONPATH": HELPERS},
    )
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors and all(e.startswith("error: step 3: a reward is not finite") for e in errors)
    # No traceback of ours (torchrun appends its own report of the failed ranks).
    assert "torchtitan_rl/" not in result.stderr
    assert invalid_reason(tmp_path / "checkpoints" / "step-2") is None
    assert not list((tmp_path / "checkpoints").glob("step-3*"))


def test_kv_cache_too_small_for_one_sequence_is_a_clear_error(tmp_path):
    result = run_train(
        "--job.config_file",
        "run_configs/debug_cpu.toml",
        "--generator.num_kv_blocks",
        "1",
        "--generator.max_model_len",
        "320",
        "--job.dump_folder",
        str(tmp_path),
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "error: the generator's KV cache cannot hold one sequence of generator.max_model_len = "
        "320 tokens: raise generator.kv_cache_space_gib (CPU) or "
        "generator.gpu_memory_utilization (GPU), raise or unset generator.num_kv_blocks, or "
        "lower generator.max_model_len"
    )


def test_preemption_keeps_logprobs_exact_and_seeded_long_steps_run(tmp_path):
    """4 KV blocks for 32 sequences of ~150 tokens: vLLM preempts and recomputes, and in
    batch-invariant mode the logprobs still equal the trainer's exactly. 2400 seeded prompt
    tokens in one step (more than vLLM's 2048-token budget) run, with the same samples as
    alone."""
    out = tmp_path / "result.json"
    run_dist(
        "generator_faults_run.py",
        str(out),
        "--job.config_file",
        "run_configs/debug_cpu.toml",
        "--generator.max_model_len",
        "320",
        "--training.max_prompt_len",
        "256",
        "--generator.num_kv_blocks",
        "4",
        "--batch_invariant",
        "true",
        "--job.dump_folder",
        str(tmp_path / "run"),
        nproc=0,
    )
    result = json.loads(out.read_text())
    assert result["preemptions"] > 0
    assert result["max_diff"] == 0.0
    assert result["budget_prompt_tokens"] > 2048
    assert result["seeded_alone_equals_together"]


def test_a_failing_checkpoint_write_stops_the_run_with_one_line(tmp_path):
    """After step 1, files of the run may not grow past 256 KiB (RLIMIT_FSIZE set on the live
    process; Python ignores SIGXFSZ, so a write fails with EFBIG as on a full disk): metrics
    still fit, the step-2 checkpoint shard does not."""
    flags = (*RUN, "--training.steps", "3", "--job.dump_folder", str(tmp_path))
    process = subprocess.Popen(
        [sys.executable, "-m", "torchtitan_rl.train", *flags],
        cwd=REPO,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        wait_for_step(process, tmp_path, 1)
        limit = 256 * 1024
        psutil.Process(process.pid).rlimit(psutil.RLIMIT_FSIZE, (limit, limit))
        _, stderr = process.communicate(timeout=300)
    finally:
        kill_tree(process)
    assert process.returncode == 1, stderr[-3000:]
    error = stderr.strip().splitlines()[-1]
    assert error.startswith("error: step 2: saving the checkpoint to "), error
    assert "File too large" in error
    assert error.endswith(
        "the latest complete checkpoint is still none: free space and restart to resume"
    )
    assert not list((tmp_path / "checkpoints").iterdir())
    assert logged_steps(tmp_path) == {1, 2}
