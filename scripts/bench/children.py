"""What the benchmarks that measure in child processes share: assets, joining the torchrun
world, result passing."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULT = "RESULT "


def ensure_checkpoint(path: str) -> None:
    """Write the tiny (or, for a path naming "debug", the debugmodel-sized) checkpoint once."""
    if (Path(path) / "torchtitan.json").is_file():
        return
    flavor = "debugmodel" if "debug" in Path(path).name else "tiny"
    script = str(REPO / "scripts" / "make_tiny_checkpoint.py")
    subprocess.run([sys.executable, script, "--out", path, "--flavor", flavor], check=True)


def report(result: dict) -> None:
    """Hand a child's measurements to the parent (the last RESULT line of its stdout)."""
    print(RESULT + json.dumps(result), flush=True)


def run_child(command: list[str]) -> dict:
    """Run a measuring child process; its reported result, or exit saying what failed."""
    child = subprocess.run(
        command,
        capture_output=True,
        text=True,
        # Threads as a user gets them: torchrun sets one per rank by itself.
        env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
    )
    lines = [line for line in child.stdout.splitlines() if line.startswith(RESULT)]
    if child.returncode != 0 or not lines:
        sys.exit(f"{' '.join(command[-2:])} failed:\n{child.stderr[-3000:]}")
    return json.loads(lines[-1][len(RESULT) :])


def join_world(flags: list[str], prog: str):
    """A child rank's start: its run config from `flags`, in the torchrun world it joins;
    returns (config, rank, world size)."""
    from torchtitan_rl import platform
    from torchtitan_rl.config import parse_args

    config = parse_args(flags, int(os.environ.get("WORLD_SIZE", "1")), prog=prog)
    platform.patch_torchtitan()
    rank, world = platform.init_distributed()
    return config, rank, world
