"""The fork server the integration tests launch through (tests/helpers/forkserver.py): a
process forked from it behaves as `python` started afresh would, and a launch it cannot
reproduce runs `python` itself."""

import signal
import subprocess
import textwrap
import time

import psutil
from helpers.launch import REPO, environment, launcher, run, start_piped

# What a program sees of its interpreter, as `python -c` prints it.
SEEN = textwrap.dedent(
    """
    import os, sys
    print("preloaded", "vllm" in sys.modules)
    print(__name__, sys.argv, os.getcwd(), sys.path[0], os.environ.get("SEEN_VAR"))
    print(sys.path[1:3])
    print("to stderr", file=sys.stderr)
    sys.exit(int(sys.argv[1]))
    """
)


def _pid_file_program(path) -> str:
    return f"import os, time; open({str(path)!r}, 'w').write(str(os.getpid())); time.sleep(120)"


def _wait_for(path) -> int:
    deadline = time.monotonic() + 60
    while not (path.is_file() and path.read_text()):
        assert time.monotonic() < deadline, f"{path} was not written in 60 s"
        time.sleep(0.05)
    return int(path.read_text())


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_gone(pids: list[int], what: str) -> None:
    deadline = time.monotonic() + 10
    while not all(_gone(pid) for pid in pids):
        assert time.monotonic() < deadline, f"{what} by 10 s"
        time.sleep(0.05)


SPAWNS = """
import multiprocessing, sys


def child(queue, word):
    queue.put((word, "vllm" in sys.modules))


if __name__ == "__main__":
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=child, args=(queue, "echo"))
    process.start()
    got = queue.get(timeout=120)
    process.join()
    print("vllm" in sys.modules, got, process.exitcode)
"""


def test_a_forked_process_is_what_python_would_be_and_the_ones_it_cannot_be_run_python(
    tmp_path,
):
    """The same program forked and run by `python`: the same output, exit code and streams; an
    uncaught exception and a script as python runs them; a multiprocessing child it spawns,
    forked too; an import-time variable or a
    PYTHONPATH that shadows a preloaded module makes the launch run python itself."""
    env = {"SEEN_VAR": "seen"}
    forked = run([*launcher(0), "-c", SEEN, "3", "x"], env=env)
    fresh = run([*launcher(0, forked=False), "-c", SEEN, "3", "x"], env=env)
    assert forked.returncode == fresh.returncode == 3
    assert forked.stdout.replace("preloaded True", "preloaded False") == fresh.stdout
    assert forked.stdout.startswith("preloaded True")  # it was forked
    assert f"__main__ ['-c', '3', 'x'] {REPO}  seen" in forked.stdout
    assert forked.stderr == fresh.stderr == "to stderr\n"

    script = tmp_path / "fails.py"
    script.write_text("import sys\nprint(__name__, sys.path[0])\nraise ValueError('bad')\n")
    failed = run([*launcher(0), str(script)])
    assert failed.returncode == 1
    assert failed.stdout == f"__main__ {tmp_path}\n"
    assert failed.stderr.startswith("Traceback") and failed.stderr.endswith("ValueError: bad\n")

    # A multiprocessing child it spawns is forked too: its pipes passed on, its result back.
    spawns = tmp_path / "spawns.py"
    spawns.write_text(SPAWNS)
    spawned = run([*launcher(0), str(spawns)])
    assert spawned.returncode == 0, spawned.stderr
    assert spawned.stdout == "True ('echo', True) 0\n"  # both preloaded: both forked
    alone = run([*launcher(0, forked=False), str(spawns)])
    assert alone.stdout == "False ('echo', False) 0\n", alone.stderr

    imported = run([*launcher(0), "-c", SEEN, "0"], env={"TORCH_SHOW_CPP_STACKTRACES": "1"})
    assert imported.stdout.startswith("preloaded False")  # run by python: torch reads it
    shadow = tmp_path / "shadow"
    (shadow / "vllm").mkdir(parents=True)
    shadowed = run([*launcher(0), "-c", SEEN, "0"], env={"PYTHONPATH": str(shadow)})
    assert shadowed.stdout.startswith("preloaded False")
    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "extra_module.py").write_text("WHERE = 'extra'\n")
    added = run(
        [*launcher(0), "-c", "import extra_module, sys; print(extra_module.WHERE, sys.path[1])"],
        env={"PYTHONPATH": str(extra)},
    )
    assert added.returncode == 0, added.stderr
    assert added.stdout == f"extra {extra}\n"


def test_signals_reach_the_forked_process_and_it_dies_with_its_client_and_torchrun(tmp_path):
    """SIGTERM to the client is the program's; the client exits with the program's code; a
    client killed with SIGKILL takes its program with it; torchrun killed with SIGKILL takes
    its forked ranks (as platform.die_with_launcher does for ranks it starts itself)."""
    handled = textwrap.dedent(
        """
        import signal, sys, time
        signal.signal(signal.SIGTERM, lambda *_: (print("terminated", flush=True), sys.exit(7)))
        print("ready", flush=True)
        time.sleep(120)
        """
    )
    process = start_piped([*launcher(0), "-c", handled])
    assert process.stdout.readline() == "ready\n"
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 7
    assert process.stdout.read() == "terminated\n"

    killed = start_piped([*launcher(0), "-c", _pid_file_program(tmp_path / "pid")])
    pid = _wait_for(tmp_path / "pid")
    assert pid != killed.pid  # the program is the fork server's child, not the client
    killed.kill()
    killed.wait(timeout=30)
    _wait_gone([pid], "the program outlived its client")

    program = _pid_file_program(tmp_path / "rank$RANK")
    torchrun = subprocess.Popen(
        [*launcher(2), "-c", program.replace("$RANK", "' + os.environ['RANK'] + '")],
        cwd=REPO,
        env=environment(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    ranks = [_wait_for(tmp_path / f"rank{rank}") for rank in (0, 1)]
    torchrun.kill()
    torchrun.wait(timeout=30)
    _wait_gone(ranks, "a forked rank outlived torchrun")
