"""What the benchmarks that measure in child processes share: assets, joining the torchrun
world, result passing; and timing a call."""

import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULT = "RESULT "


def median_ms(fn, repeats: int, warmup: int = 1) -> float:
    """Median milliseconds of `fn()` over `repeats` calls, after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def ensure_checkpoint(path: str) -> None:
    """Write the tiny (or, for a path naming "debug", the debugmodel-sized) checkpoint once;
    a path naming "moe" gets qwen3's mixture-of-experts flavor of that size, one naming
    "gpt_oss" gpt-oss's, one naming "deepseek_v3" DeepSeek-V3's, one naming "qwen3_5"
    Qwen3.5's. A folder that holds a checkpoint already (a config.json: the project's, or a
    pretrained one such as assets/smollm2_135m_instruct) is left as it is."""
    if (Path(path) / "config.json").is_file():
        return
    name = Path(path).name
    model = next((m for m in ("gpt_oss", "deepseek_v3", "qwen3_5") if m in name), "qwen3")
    flavor = "debugmodel" if "debug" in name else "tiny"
    flavor = f"{flavor}_moe" if "moe" in name else flavor
    script = str(REPO / "scripts" / "make_tiny_checkpoint.py")
    command = [sys.executable, script, "--out", path, "--model", model, "--flavor", flavor]
    subprocess.run(command, check=True)


def report(result: dict) -> None:
    """Hand a child's measurements to the parent (the last RESULT line of its stdout)."""
    print(RESULT + json.dumps(result), flush=True)


def run_child(command: list[str], env: dict[str, str] | None = None) -> dict:
    """Run a measuring child process (`env`: variables it adds); its reported result, or exit
    saying what failed."""
    child = subprocess.run(
        command,
        capture_output=True,
        text=True,
        # Threads as a user gets them: torchrun sets one per rank by itself.
        env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **(env or {})},
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


def peak_rss_gib() -> float:
    """Peak RSS of this process, GiB (ru_maxrss is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def children_peak_rss_gib() -> float:
    """The largest peak RSS of this process's children that ended, GiB (a generator rank's
    engine process, once joined)."""
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20


def tree_rss_bytes(root: int) -> int:
    """Total RSS of every descendant of process `root` (shared pages counted in each)."""
    parents, rss = {}, {}
    page = os.sysconf("SC_PAGE_SIZE")
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
            parents[int(entry.name)] = int(fields[1])
            rss[int(entry.name)] = int(fields[21]) * page
        except (OSError, IndexError, ValueError):
            continue  # the process ended meanwhile
    total, frontier = 0, [root]
    while frontier:
        pid = frontier.pop()
        kids = [p for p, parent in parents.items() if parent == pid]
        total += sum(rss[k] for k in kids)
        frontier.extend(kids)
    return total


def available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return float("inf")


class MemoryWatch:
    """Samples the total RSS of this process's descendants; kills its direct children (the
    torchrun launcher, whose ranks die with it) if available memory falls under `min_gib`."""

    def __init__(self, min_gib: float, interval_s: float = 0.2):
        self.min_gib, self.interval_s = min_gib, interval_s
        self.peak, self.fired, self.min_available = 0, False, available_gib()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        me = os.getpid()
        while not self.done.wait(self.interval_s):
            self.peak = max(self.peak, tree_rss_bytes(me))
            self.min_available = min(self.min_available, available_gib())
            if self.min_available < self.min_gib and not self.fired:
                self.fired = True
                for entry in os.scandir("/proc"):
                    if entry.name.isdigit() and self.parent(entry.path) == me:
                        os.kill(int(entry.name), 9)

    @staticmethod
    def parent(path: str) -> int:
        try:
            return int(Path(path, "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return -1

    def __enter__(self) -> "MemoryWatch":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()
