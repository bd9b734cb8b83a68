# torch 2.11 has no torch.distributed.fsdp.DataParallelMeshDims, which torchtitan 0.3.0 imports
# (it targets torch 2.13): a stand-in of its fields, enough to import; FSDP calls passing it fail.
import dataclasses

import torch.distributed.fsdp as fsdp

if not hasattr(fsdp, "DataParallelMeshDims"):

    @dataclasses.dataclass
    class DataParallelMeshDims:
        shard: object = None
        replicate: object = None

    fsdp.DataParallelMeshDims = DataParallelMeshDims
