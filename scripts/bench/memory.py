"""Where a colocated rank's memory goes: one JSON line of RSS figures, GiB, per phase.

    .venv/bin/python scripts/bench/memory.py --nproc 2 \
        --job.config_file run_configs/debug_cpu.toml --training.steps 3 [train flags]

Runs the colocated placement for `training.steps` steps under `torchrun --nproc_per_node N`;
rank 0 reads its RSS (VmRSS) after each part is built and, resetting the peak
(/proc/self/clear_refs) before each phase of every step, the peak (VmHWM) each phase reaches:

- `base`: the interpreter, torch, vLLM and the process groups, before any model;
- `engine`: what building the engine adds (its weights, the KV cache it touches, buffers);
- `trainer`: what the learner adds (the policy's shard, a reference or teacher if any);
- `optimizer`: what stays after the first train phase (AdamW's two moments, gradients);
- `generate_peak`, `train_peak`, `sync_peak`: the most each phase of the last step holds above
  the RSS it started from (activations and transient buffers), and `step_peak`: the rank's
  peak RSS over the last step; `peak`: the rank's peak over the run (ru_maxrss).

`kv_cache` is the engine's KV cache as configured (blocks x block bytes), beside what it
touched.
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


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS


def measure(flags: list[str]) -> None:
    config, rank, world = join_world(flags, prog="scripts/bench/memory.py")
    from torchtitan_rl import platform
    from torchtitan_rl.generator import engine
    from torchtitan_rl.learner import Learner
    from torchtitan_rl.placements import colocated

    figures: dict[str, float] = {"base": rss_gib()}

    def built(cls, name: str) -> None:
        init = cls.__init__

        @functools.wraps(init)
        def wrapped(self, *args, **kwargs):
            before = rss_gib()
            init(self, *args, **kwargs)
            figures[name] = rss_gib() - before

        cls.__init__ = wrapped

    built(engine.LocalGenerator, "engine")
    built(Learner, "trainer")
    trainer = colocated.RLTrainer(config)
    phases = {
        "generate": (trainer.producer, "rollouts"),
        "train": (trainer.learner, "learn"),
        "sync": (trainer.transport, "send"),
    }
    for name, (owner, method) in phases.items():
        call = getattr(owner, method)

        def timed(*args, _call=call, _name=name, **kwargs):
            before = rss_gib()
            reset_peak()
            out = _call(*args, **kwargs)
            figures[f"{_name}_peak"] = rss_gib("VmHWM") - before
            figures[f"{_name}_after"] = rss_gib() - before
            return out

        setattr(owner, method, timed)
    for step in range(1, config.training.steps + 1):
        before = rss_gib()
        reset_peak()
        trainer.train_step(step)
        figures["step_peak"] = rss_gib("VmHWM")
        figures.setdefault("rss_after_steps", []).append(round(rss_gib(), 3))
        if step == 1:
            figures["optimizer"] = rss_gib() - before
    figures["peak"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    figures["kv_cache"] = kv_cache_gib(trainer.generator)
    platform.shutdown_distributed()
    if rank == 0:
        report({k: v if isinstance(v, list) else round(v, 3) for k, v in figures.items()} | {"world": world})


def kv_cache_gib(generator) -> float:
    """The engine's KV cache as allocated: blocks x block bytes, summed over its layers."""
    (total,) = generator.engine.collective_rpc(_kv_cache_bytes)
    return total / 2**30


def _kv_cache_bytes(worker) -> int:
    return sum(c.numel() * c.element_size() for c in worker.model_runner.kv_caches)


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
    result = run_child(command)
    print(json.dumps(result))


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
