# torch 2.11 (the lent GPU machines') stand-ins for what this project's torch 2.13 has; each
# applies only where it is missing, so on 2.13 this file does nothing.
import dataclasses
import inspect

import torch.distributed.fsdp as fsdp
import torch.nn.attention.varlen as varlen_module

# torch 2.11 has no torch.distributed.fsdp.DataParallelMeshDims, which torchtitan 0.3.0 imports
# (it targets torch 2.13): a stand-in of its fields, enough to import; FSDP calls passing it fail.
if not hasattr(fsdp, "DataParallelMeshDims"):

    @dataclasses.dataclass
    class DataParallelMeshDims:
        shard: object = None
        replicate: object = None

    fsdp.DataParallelMeshDims = DataParallelMeshDims

# torch 2.11's varlen_attn has no `enable_gqa`, which trainer/packed_attention.varlen passes
# (GQA models: Qwen3): repeat the kv heads here instead (scripts/gpu_check.py does the same).
_varlen_attn = varlen_module.varlen_attn
if "enable_gqa" not in inspect.signature(_varlen_attn).parameters:

    def varlen_attn(q, k, v, *args, enable_gqa=False, **kwargs):
        if enable_gqa and k.shape[-2] != q.shape[-2]:
            k, v = (x.repeat_interleave(q.shape[-2] // x.shape[-2], dim=-2) for x in (k, v))
        return _varlen_attn(q, k, v, *args, **kwargs)

    varlen_module.varlen_attn = varlen_attn
