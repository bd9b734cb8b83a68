"""Benchmark WeightSync against memcpy and against vLLM's own ways to update weights.

    .venv/bin/python scripts/bench/weight_sync.py --checkpoint assets/tiny_qwen3 --procs 1

Children measure, the parent prints one JSON line:
- ours (under torchrun with --procs ranks): FSDP trainer + our generator per rank; median
  `sync_ms` of LocalTransport.send (gather, in-place copy, repack, prefix-cache reset), `copy_ms`
  of the gather + in-place copy alone, `bytes`, `gbps`, and `memcpy_ms`: one `copy_` of the same
  number of bytes between preallocated buffers, the physical limit here; `ratio_vs_memcpy` =
  sync_ms / memcpy_ms. `--no-pack` turns off the generator's packed GEMM copies (no repack).
  Ranks on one host gather through shared memory (`transport`); `process_group_copy_ms` is the
  same copy through the process group's all-gather (gloo over loopback), for comparison.
- native (one process): vLLM's native model for the checkpoint; `reload_weights_ms` is vLLM's
  in-place `reload_weights` from the same tensors in memory, `file_reload_ms` saves them as
  safetensors and reloads from disk.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

from children import REPO, ensure_checkpoint, median_ms, report, run_child


def measure_ours(args) -> dict | None:
    import torch
    import torch.distributed as dist

    from torchtitan_rl import platform
    from torchtitan_rl.config import (
        GeneratorSection,
        ModelSection,
        ParallelismSection,
        TrainingSection,
    )
    from torchtitan_rl.generator.engine import LocalGenerator
    from torchtitan_rl.trainer.policy_trainer import PolicyTrainer
    from torchtitan_rl.weight_sync import LocalTransport

    platform.patch_torchtitan()
    rank, world = platform.init_distributed()
    flavor = json.loads((Path(args.checkpoint) / "torchtitan.json").read_text())["flavor"]
    model = ModelSection(hf_checkpoint=args.checkpoint, flavor=flavor)
    trainer = PolicyTrainer(
        model=model, training=TrainingSection(), parallelism=ParallelismSection()
    )
    generator = LocalGenerator(
        generator=GeneratorSection(max_model_len=128, cpu_packed_gemm=not args.no_pack),
        model=model,
    )
    transport = LocalTransport(trainer, generator, bucket_mb=args.bucket_mb, verify=False)
    sync = transport.copier

    stats = []

    def one_sync():
        dist.barrier()
        stats.append(transport.send(version=len(stats) + 1))

    sync_ms = median_ms(one_sync, args.repeats)
    copy_ms = median_ms(sync.copy, args.repeats)
    shared, process_group_ms = sync.shared, None
    if shared is not None:  # the same copy through the process group's all-gather (gloo)
        sync.shared = None
        process_group_ms = median_ms(sync.copy, args.repeats)
        sync.shared = shared
    nbytes = stats[-1].bytes
    src, dst = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    src.fill_(1)
    memcpy_ms = median_ms(lambda: dst.copy_(src), args.repeats)
    platform.shutdown_distributed()
    if rank != 0:
        return None
    return {
        "nproc": world,
        "packed_gemm": not args.no_pack,
        "sync_ms": round(sync_ms, 2),
        "copy_ms": round(copy_ms, 2),
        "bytes": nbytes,
        "gbps": round(nbytes / sync_ms / 1e6, 2),
        "peak_extra_bytes": stats[-1].peak_extra_bytes,
        "memcpy_ms": round(memcpy_ms, 2),
        "ratio_vs_memcpy": round(sync_ms / memcpy_ms, 2),
        "copy_ratio_vs_memcpy": round(copy_ms / memcpy_ms, 2),
        "transport": "shared_memory" if shared is not None else "process_group",
        "process_group_copy_ms": None if process_group_ms is None else round(process_group_ms, 2),
    }


def measure_native(args) -> dict:
    from safetensors.torch import load_file, save_file

    from torchtitan_rl.config import GeneratorSection, ModelSection
    from torchtitan_rl.generator.engine import LocalGenerator

    generator = LocalGenerator(
        generator=GeneratorSection(max_model_len=128),
        model=ModelSection(hf_checkpoint=args.checkpoint),
        native=True,
    )
    state = {}
    for file in sorted(Path(args.checkpoint).glob("*.safetensors")):
        state.update(load_file(file))

    def reload(**kwargs):
        generator.engine.collective_rpc(lambda worker: worker.model_runner.reload_weights(**kwargs))

    reload_ms = median_ms(lambda: reload(weights_iterator=iter(state.items())), args.repeats)
    with tempfile.TemporaryDirectory() as tmp:

        def save_and_reload():
            save_file(state, Path(tmp) / "model.safetensors")
            reload(weights_path=tmp)

        file_ms = median_ms(save_and_reload, args.repeats)
    return {"reload_weights_ms": round(reload_ms, 2), "file_reload_ms": round(file_ms, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=str(REPO / "assets" / "tiny_qwen3"))
    parser.add_argument("--procs", type=int, default=1, help="trainer ranks")
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-pack", action="store_true", help="generator.cpu_packed_gemm = false")
    parser.add_argument("--side", choices=["ours", "native"], help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.side:  # a child process measuring one side
        from torchtitan_rl import platform

        result = measure_ours(args) if args.side == "ours" else measure_native(args)
        if result is not None:
            report(result)
        platform.exit_process(0)  # also skips vLLM's slow teardown

    ensure_checkpoint(args.checkpoint)
    me = [__file__, *sys.argv[1:]]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    ours = run_child([*torchrun, "--nproc_per_node", str(args.procs), *me, "--side", "ours"])
    native = run_child([sys.executable, *me, "--side", "native"])
    result = {"bench": "weight_sync", "checkpoint": args.checkpoint, **ours, **native}
    result["speedup_vs_reload_weights"] = round(native["reload_weights_ms"] / ours["sync_ms"], 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
