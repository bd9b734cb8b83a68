"""WeightSync from fp32 FSDP shards into a bf16 copy: the gather runs in bf16, through shared
memory (the ranks share this host) and through the process group's all-gather (as across
hosts, or NCCL on CUDA).

    torchrun --nproc_per_node 2 tests/dist/weight_sync_dtype_run.py OUT_DIR

Rank 0 saves, per transport, the sync's stats and whether every bf16 target equals its fp32
source cast to bf16, bit for bit.
"""

import sys
from pathlib import Path

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from torchtitan_rl import platform
from torchtitan_rl.weight_sync import WeightSync


def main() -> None:
    out = Path(sys.argv[1])
    rank, world = platform.init_distributed()
    torch.manual_seed(0)
    trainer = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 64))
    generator = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 64)).to(torch.bfloat16)
    fully_shard(trainer, mesh=init_device_mesh("cpu", (world,)))
    sync = WeightSync(
        dict(trainer.named_parameters()), dict(generator.named_parameters()), bucket_mb=1.0
    )
    result = {"shared_memory": sync.shared is not None}
    for transport, shared in (("shared", sync.shared), ("process_group", None)):
        sync.shared = shared
        with torch.no_grad():
            for target in generator.parameters():
                target.zero_()
        written, peak = sync.copy()
        equal = all(
            torch.equal(target, source.full_tensor().to(torch.bfloat16))
            for target, source in zip(generator.parameters(), trainer.parameters(), strict=True)
        )
        result[transport] = {"written": written, "peak": peak, "equal": equal}
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        torch.save(result, out / "result.pt")
    platform.shutdown_distributed()


if __name__ == "__main__":
    main()
    platform.exit_process(0)
