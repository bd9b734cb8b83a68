"""The launcher under a real `torchrun --nproc_per_node 2` and as a plain process.

.venv/bin/python -m pytest tests/test_launcher.py
"""

import subprocess
import tomllib

from helpers.launch import run_train
from test_console import CHATTER

DEBUG_TOML = "run_configs/debug_cpu.toml"


def launch(nproc: int, *flags: str) -> subprocess.CompletedProcess:
    return run_train("--job.config_file", DEBUG_TOML, *flags, nproc=nproc)


def test_torchrun_two_ranks_train_and_write_the_config(tmp_path):
    dump = tmp_path / "run"
    result = launch(2, "--job.dump_folder", str(dump), "--training.steps", "3")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step    3 | reward" in result.stdout

    # The console shows this project's lines and the summary; library output is in run.log.
    console = result.stdout + result.stderr
    assert [marker for marker in CHATTER if marker in console] == [], console
    assert result.stderr == ""  # torchrun's own OMP_NUM_THREADS notice is off (conftest sets it)
    lines = result.stdout.splitlines()
    assert lines[0] == (
        f"starting: library output goes to {dump / 'run.log'} (--job.verbose shows it here)"
    )
    assert all(lines[s].startswith(f"step    {s} | reward") for s in (1, 2, 3)), lines
    assert lines[4].startswith("done: trained to step 3 in "), lines
    assert f"metrics:     {dump / 'metrics.jsonl'}" in lines
    assert f"library log: {dump / 'run.log'} (other ranks: run.rank<N>.log)" in lines
    assert len(lines) <= 11, lines
    log = (dump / "run.log").read_text()
    assert "DTensor random operators" in log and ") WARNING " in log  # torch's, vLLM's
    assert "step    2 | reward" in log  # the console's lines too, in order with the rest
    assert "DTensor random operators" in (dump / "run.rank1.log").read_text()

    # The written config is the resolved one, and feeding it back reproduces it.
    written = (dump / "config.toml").read_text()
    assert tomllib.loads(written)["training"]["steps"] == 3
    again = run_train("--job.config_file", str(dump / "config.toml"), "--job.dry_run")
    assert again.returncode == 0, again.stderr
    assert again.stdout == written


def test_plain_process_is_a_world_of_one(tmp_path):
    result = launch(0, "--job.dump_folder", str(tmp_path / "run"), "--training.steps", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step    2 | reward" in result.stdout
    assert (tmp_path / "run" / "config.toml").is_file()
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2


def test_torchrun_world_size_mismatch_fails_on_every_rank(tmp_path):
    result = launch(2, "--parallelism.dp_shard", "4", "--job.dump_folder", str(tmp_path))
    assert result.returncode != 0
    # Every rank fails alike, but torchrun stops the others as soon as the first exits, so one
    # or two copies of the line appear; torchrun then adds its own ChildFailedError report,
    # which is torchrun's, so only the absence of frames from our code is asserted.
    message = "error: parallelism.dp_replicate * dp_shard * tp = 4 but the world size is 2"
    assert result.stderr.count(message) >= 1, result.stderr
    assert "torchtitan_rl/" not in result.stderr
    assert not (tmp_path / "config.toml").exists()


def test_torchrun_wrong_flavor_for_the_checkpoint_names_the_tensor(tmp_path):
    result = launch(2, "--model.flavor", "debugmodel", "--job.dump_folder", str(tmp_path))
    assert result.returncode != 0
    message = (
        "error: model.hf_checkpoint = 'assets/tiny_qwen3': 'model.embed_tokens.weight' has "
        "shape (68, 128) but model.flavor = 'debugmodel' expects (2048, 256)"
    )
    assert result.stderr.count(message) >= 1, result.stderr[-3000:]
    assert "torchtitan_rl/" not in result.stderr
