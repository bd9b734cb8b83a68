"""Where each rank's memory goes, in any placement: one JSON line of RSS figures, GiB, per rank.

    .venv/bin/python scripts/bench/memory.py --nproc 2 \
        --job.config_file run_configs/debug_cpu.toml --training.steps 3 [train flags]
        [--generator.placement continuous --algorithm.max_offpolicy_steps 1]

Runs the placement for `training.steps` steps under `torchrun --nproc_per_node N`; each rank
reads its RSS (VmRSS) after each part is built and, resetting its peak (/proc/self/clear_refs)
before each phase, the peak (VmHWM) each phase reaches. Per rank ("ranks": one dict each):

- `base`: the interpreter, torch, vLLM and the process groups, before any model;
- `engine`: what building an in-process engine adds (its weights and packed copies, the KV
  cache it touches); a disaggregated or continuous generator rank's engine lives in a child
  process instead, counted in `children_peak` (the largest peak RSS of this rank's child
  processes that ended);
- `trainer`: what the learner adds (the policy's shard, a reference or teacher if any);
- `after_first_step`: what the first step leaves on a trainer rank: AdamW's two moments
  (`adamw_state`, as allocated) and the heap glibc keeps from the first train phase's
  activations, which later steps reuse;
- `generate_peak`, `train_peak`, `sync_peak`: the most each phase of the last step held above
  the RSS it started from (activations and transient buffers); `step_peak`: the rank's peak
  over its last step; `rss_after_steps`; `peak`: the rank's peak over the run;
- `kv_cache`: an in-process engine's KV cache as allocated (blocks x block bytes).
"""

import functools
import json
import resource
import sys

from children import REPO, join_world, report, run_child


def rss_gib(field: str = "VmRSS") -> float:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 2**20
    raise RuntimeError(f"/proc/self/status has no {field}")


class Peak:
    """This process's peak RSS over the run and since its step began, across the resets of
    VmHWM that time each phase (a reset resets ru_maxrss too, so the run's is kept here)."""

    def __init__(self):
        self.run = self.step = 0.0

    def reset(self) -> None:
        """Reset VmHWM for a phase, keeping what it had reached."""
        reached = rss_gib("VmHWM")
        self.run, self.step = max(self.run, reached), max(self.step, reached)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS

    def start_step(self) -> None:
        self.reset()
        self.step = 0.0

    def of_step(self) -> float:
        return max(self.step, rss_gib("VmHWM"))

    def of_run(self) -> float:
        return max(self.run, rss_gib("VmHWM"))


def measure(flags: list[str]) -> None:
    config, rank, world = join_world(flags, prog="scripts/bench/memory.py")
    from torchtitan_rl import placements, platform
    from torchtitan_rl.generator import engine
    from torchtitan_rl.learner import Learner
    from torchtitan_rl.loop import Hooks
    from torchtitan_rl.producer import RolloutProducer
    from torchtitan_rl.weight_sync import broadcast, local

    figures: dict = {"base": rss_gib()}
    held: dict = {}
    peak = Peak()

    def built(cls, name: str) -> None:
        init = cls.__init__

        @functools.wraps(init)
        def wrapped(self, *args, **kwargs):
            before = rss_gib()
            init(self, *args, **kwargs)
            figures[name] = rss_gib() - before
            held[name] = self

        cls.__init__ = wrapped

    def phase(cls, method: str, name: str) -> None:
        call = getattr(cls, method)

        @functools.wraps(call)
        def wrapped(*args, **kwargs):
            before = rss_gib()
            peak.reset()
            out = call(*args, **kwargs)
            figures[f"{name}_peak"] = rss_gib("VmHWM") - before
            return out

        setattr(cls, method, wrapped)

    built(engine.LocalGenerator, "engine")
    built(Learner, "trainer")
    phase(RolloutProducer, "rollouts", "generate")
    phase(Learner, "learn", "train")
    phase(local.LocalTransport, "send", "sync")
    phase(broadcast.BroadcastSender, "send", "sync")

    class Steps(Hooks):
        def before_step(self, step: int) -> None:
            self.rss = rss_gib()
            peak.start_step()

        def after_step(self, step: int, metrics: dict[str, float]) -> None:
            figures["step_peak"] = peak.of_step()
            figures.setdefault("rss_after_steps", []).append(round(rss_gib(), 3))
            if step == 1:
                figures["after_first_step"] = rss_gib() - self.rss

    placements.run(config, Steps())
    figures["peak"] = peak.of_run()
    figures["children_peak"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    if "engine" in held:
        figures["kv_cache"] = held["engine"].kv_cache_bytes() / 2**30
    if "trainer" in held:
        figures["adamw_state"] = adamw_state_gib(held["trainer"].trainer)
    rounded = {k: v if isinstance(v, list) else round(v, 3) for k, v in figures.items()}
    ranks = platform.all_gather_objects(rounded)
    platform.shutdown_distributed()
    if rank == 0:
        report({"placement": config.generator.placement, "world": world, "ranks": ranks})


def adamw_state_gib(policy) -> float:
    """The optimizer state this rank holds (its shard of AdamW's moments)."""
    import torch
    from torch.distributed.tensor import DTensor

    def nbytes(t) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    states = [s for o in policy.optimizers.optimizers for s in o.state.values()]
    return sum(nbytes(t) for s in states for t in s.values() if torch.is_tensor(t)) / 2**30


def main() -> None:
    args = sys.argv[1:]
    if args and args[0] == "--child":
        measure(args[1:])
        return
    nproc = "1"
    if "--nproc" in args:
        i = args.index("--nproc")
        nproc = args[i + 1]
        del args[i : i + 2]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command = [*torchrun, "--nproc_per_node", nproc, __file__, "--child", *args]
    print(json.dumps(run_child(command)))


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
