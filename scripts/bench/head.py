"""The LM head's memory under trainer TP: logprobs forward + backward at a real head shape
(Qwen3-0.6B: 151,936 x 1,024), with the weight gathered on each of 2 ranks (what TP did
before: the whole [V, D] weight, its gradient and [chunk, V] blocks) against vocabulary-
parallel (each rank its V/2 rows, [chunk, V/2] blocks). Prints one JSON line: each path's
peak RSS per rank above the process's start, its seconds, and `peak_ratio` = parallel / whole.

    .venv/bin/python scripts/bench/head.py [--tokens 4096 --vocab 151936 --dim 1024]

Each path runs in its own torchrun world (a process's peak RSS never goes down). Both compute
the same logprobs and gradients (tests/integration/test_policy_trainer.py checks that).
"""

import argparse
import json
import os
import sys
import time

from children import REPO, peak_rss_gib, report, run_child


def measure(args) -> None:
    """One rank of one path: build the head's inputs, run forward + backward, report."""
    import torch
    import torch.distributed as dist

    from torchtitan_rl import platform
    from torchtitan_rl.trainer.logprobs import head_logprobs

    rank, world = platform.init_distributed()
    torch.manual_seed(0)
    hidden_ND = torch.randn(args.tokens, args.dim).requires_grad_()
    targets_N = torch.randint(0, args.vocab, (args.tokens,))
    rows = -(-args.vocab // world)
    parallel = args.path == "parallel"
    shard_VD = torch.randn(rows, args.dim) * 0.02  # this rank's rows, as TP holds them
    dist.barrier()
    start_gib, began = peak_rss_gib(), time.perf_counter()
    if parallel:
        weight = shard_VD.requires_grad_()
        group, first = dist.group.WORLD, rank * rows
    else:
        # Gathered, as `full_tensor()` did: every rank holds the whole weight.
        pieces = [torch.empty_like(shard_VD) for _ in range(world)]
        dist.all_gather(pieces, shard_VD)
        weight = torch.cat(pieces)[: args.vocab].requires_grad_()
        group, first = None, 0
    logprobs_N, _ = head_logprobs(hidden_ND, weight, targets_N, group=group, first=first)
    logprobs_N.sum().backward()
    seconds = time.perf_counter() - began
    peaks = [None] * world
    dist.all_gather_object(peaks, peak_rss_gib() - start_gib)
    if rank == 0:
        report({"peak_gib_per_rank": [round(p, 3) for p in peaks], "seconds": round(seconds, 2)})
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--path", choices=["whole", "parallel"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.path:
        measure(args)
        return
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    result = {"tokens": args.tokens, "vocab": args.vocab, "dim": args.dim, "ranks": 2}
    shape = ["--tokens", str(args.tokens), "--vocab", str(args.vocab), "--dim", str(args.dim)]
    for path in ("whole", "parallel"):
        command = [*torchrun, "--nproc_per_node", "2", __file__, *shape, "--path", path]
        result[path] = run_child(command)
    whole, parallel = (max(result[p]["peak_gib_per_rank"]) for p in ("whole", "parallel"))
    result["peak_ratio"] = round(parallel / whole, 3)
    print(json.dumps(result))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONPATH", str(REPO))
    main()
