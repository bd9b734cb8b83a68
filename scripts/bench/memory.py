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
    """This process's peak RSS since `start`, across the resets of VmHWM that time phases."""

    def __init__(self):
        self.since = 0.0

    def start(self) -> None:
        reset_peak()
        self.since = 0.0

    def reset(self) -> None:
        """Reset VmHWM for a phase, keeping what it had reached."""
        self.since = max(self.since, rss_gib("VmHWM"))
        reset_peak()

    def value(self) -> float:
        return max(self.since, rss_gib("VmHWM"))


RUN_PEAK = [0.0]
"""The most VmHWM reached before any reset: resetting it resets ru_maxrss too."""


def reset_peak() -> None:
    RUN_PEAK[0] = max(RUN_PEAK[0], rss_gib("VmHWM"))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS (and ru_maxrss with it)


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
    step_peak = Peak()

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
            step_peak.reset()
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
            step_peak.start()

        def after_step(self, step: int, metrics: dict[str, float]) -> None:
            figures["step_peak"] = step_peak.value()
            figures.setdefault("rss_after_steps", []).append(round(rss_gib(), 3))
            if step == 1:
                figures["after_first_step"] = rss_gib() - self.rss

    placements.run(config, Steps())
    figures["peak"] = max(RUN_PEAK[0], rss_gib("VmHWM"))
    figures["children_peak"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    if "engine" in held:
        figures["kv_cache"] = kv_cache_gib(held["engine"])
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


def kv_cache_gib(generator) -> float:
    """The engine's KV cache as allocated: blocks x block bytes, summed over its layers."""
    (total,) = generator.engine.collective_rpc(_kv_cache_bytes)
    return total / 2**30


def _kv_cache_bytes(worker) -> int:
    """Layers of different KV-cache groups share tensors (gpt-oss): each storage once."""
    caches = worker.model_runner.kv_caches
    return sum(
        {c.untyped_storage().data_ptr(): c.untyped_storage().nbytes() for c in caches}.values()
    )


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
