"""The entry point under a real `torchrun --nproc_per_node 2` and as a plain process: the
console shows this project's lines, library output goes to {job.dump_folder}/run.log.

    .venv/bin/python -m pytest tests/integration/test_launcher.py

The torchrun case is the session's reference run (tests/integration/conftest.py).
"""

import subprocess
import sys
import textwrap
import tomllib

from helpers.launch import DEBUG_TOML, REPO, launcher, metric_rows, run, run_train

# Seen on the console of a 2-rank CPU run before the redirect: torch's DTensor UserWarning,
# vLLM's "(MainProcess pid=...) WARNING" lines, a FutureWarning from vLLM's Triton shim,
# Triton's notice, the NUMA notice from C++ (fd 2), the tcmalloc hint, the shard-loading bar.
CHATTER = (
    "DTensor",
    "WARNING",
    "UserWarning",
    "FutureWarning",
    "Triton",
    "NUMA",
    "LD_PRELOAD",
    "Loading safetensors",
)


def test_torchrun_two_ranks_train_and_write_the_config(reference_run):
    dump, result = reference_run.folder, reference_run.result
    steps = len(metric_rows(dump))
    assert steps == 6 and f"step    {steps} | reward" in result.stdout

    # The console shows this project's lines and the summary; library output is in run.log.
    console = result.stdout + result.stderr
    assert [marker for marker in CHATTER if marker in console] == [], console
    assert result.stderr == ""  # torchrun's own OMP_NUM_THREADS notice is off (helpers.launch)
    lines = result.stdout.splitlines()
    assert lines[0] == (
        f"starting: library output goes to {dump / 'run.log'} (--job.verbose shows it here)"
    )
    assert all(lines[s].startswith(f"step    {s} | reward") for s in range(1, steps + 1)), lines
    assert lines[steps + 1] == f"exported the policy to {dump / 'hf'}", lines
    assert lines[steps + 2].startswith(f"done: trained to step {steps} in "), lines
    assert f"metrics:     {dump / 'metrics.jsonl'}" in lines
    assert f"library log: {dump / 'run.log'} (other ranks: run.rank<N>.log)" in lines
    assert len(lines) <= 2 + steps + 7, lines  # the start, a line per step, export, summary
    log = (dump / "run.log").read_text()
    assert "DTensor random operators" in log and ") WARNING " in log  # torch's, vLLM's
    assert "step    2 | reward" in log  # the console's lines too, in order with the rest
    assert "DTensor random operators" in (dump / "run.rank1.log").read_text()

    # The written config is the resolved one, and feeding it back reproduces it.
    written = (dump / "config.toml").read_text()
    assert tomllib.loads(written)["training"]["steps"] == steps
    feed_back = ["--job.config_file", str(dump / "config.toml"), "--job.dry_run"]
    again = run([*launcher(0), "-m", "torchtitan_rl.train", *feed_back])
    assert again.returncode == 0, again.stderr
    assert again.stdout == written


def test_plain_process_is_a_world_of_one_and_verbose_shows_library_output(tmp_path):
    dump = tmp_path / "run"
    result = run_train(
        *("--job.config_file", DEBUG_TOML, "--training.steps", "2", "--job.verbose"),
        *("--job.dump_folder", str(dump)),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step    2 | reward" in result.stdout
    assert (dump / "config.toml").is_file()
    assert [row["step"] for row in metric_rows(dump)] == [1, 2]
    # --job.verbose: library output on the console, no run.log.
    assert "DTensor random operators" in result.stderr
    assert ") WARNING " in result.stdout  # vLLM logs to stdout
    assert not (dump / "run.log").exists()


def launch(nproc: int, *flags: str) -> subprocess.CompletedProcess:
    return run_train("--job.config_file", DEBUG_TOML, *flags, nproc=nproc)


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


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_redirect_sends_c_and_python_output_to_the_log_and_ours_to_both(tmp_path):
    (tmp_path / "run.rank1.log").write_text("an earlier run\n")
    result = run_python(f"""
        import os, sys, warnings
        from torchtitan_rl import console
        print("before", flush=True)
        console.redirect({str(tmp_path)!r}, rank=1)
        os.write(2, b"from C on fd 2\\n")
        os.write(1, b"from C on fd 1\\n")
        print("python print")
        warnings.warn("a library warning")
        console.say("ours on stdout")
        console.warn("warning: ours on stderr")
        console.error("error: ours")
        """)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "before\nours on stdout\n"
    assert result.stderr == "warning: ours on stderr\nerror: ours\n"
    log = (tmp_path / "run.rank1.log").read_text().splitlines()
    assert log[0] == "an earlier run"  # appended to, not replaced
    assert log[1:3] == ["from C on fd 2", "from C on fd 1"]
    assert log[3] == "python print"
    assert "UserWarning: a library warning" in log[4]
    assert log[-3:] == ["ours on stdout", "warning: ours on stderr", "error: ours"]
    assert not (tmp_path / "run.log").exists()


def test_an_unexpected_error_shows_its_traceback_and_points_at_the_log(tmp_path):
    # The failure is injected in place of the run (which would take a model and an engine).
    result = run_python(f"""
        import sys
        from torchtitan_rl import launch, train

        def run(config, program, opened):
            raise RuntimeError("boom")

        launch.run = run
        sys.exit(train.main(["--job.config_file", {DEBUG_TOML!r},
                             "--job.dump_folder", {str(tmp_path)!r}]))
        """)
    assert result.returncode == 1
    assert result.stdout.startswith("starting: library output goes to")
    lines = result.stderr.splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    assert "RuntimeError: boom" in lines
    assert lines[-1] == f"see {tmp_path / 'run.log'} for library output"
    assert "RuntimeError: boom" in (tmp_path / "run.log").read_text()
