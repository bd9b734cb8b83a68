"""The trainer's parallel layout: torchtitan's `ParallelDims` and `ParallelismConfig` for a
`[parallelism]` section, and the spec's `parallelize_fn` applied with them.

    .venv/bin/python -m pytest tests/integration/test_policy_trainer.py

FSDP2 (dp_shard), HSDP (dp_replicate x dp_shard), TP and EP (mixture-of-experts layers: the
experts sharded over `ep` ranks, tokens traded by all-to-all), as torchtitan's Trainer builds
them; gradients are summed over data-parallel ranks (losses carry their own normalization).
"""

from types import SimpleNamespace

import torch.nn as nn
from torchtitan.config.configs import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import utils as dist_utils
from torchtitan.distributed.fsdp import disable_fsdp_gradient_division
from torchtitan.protocols.model_spec import ModelSpec

from torchtitan_rl import batch_invariant, platform
from torchtitan_rl.config import ParallelismSection
from torchtitan_rl.trainer.compile import compilable_attention


def layout(
    parallelism: ParallelismSection, world_size: int
) -> tuple[ParallelDims, ParallelismConfig]:
    """torchtitan's view of `parallelism` over `world_size` ranks."""
    dp_shard = parallelism.resolved_dp_shard(world_size)
    spmd_backend = platform.spmd_backend()
    # torchtitan's Trainer sets this process-wide before building; its EP dispatcher reads
    # it (under the default "spmd_types" it looks for a mesh that partial_dtensor never set).
    dist_utils.set_spmd_backend(spmd_backend)
    dims = ParallelDims(
        dp_replicate=parallelism.dp_replicate,
        dp_shard=dp_shard,
        cp=1,
        tp=parallelism.tp,
        pp=1,
        ep=parallelism.ep,
        world_size=world_size,
        spmd_backend=spmd_backend,
    )
    config = ParallelismConfig(
        data_parallel_replicate_degree=parallelism.dp_replicate,
        data_parallel_shard_degree=dp_shard,
        tensor_parallel_degree=parallelism.tp,
        expert_parallel_degree=parallelism.ep,
        # Under batch-invariant mode a row-parallel layer's output is the whole canonical sum,
        # replicated (batch_invariant.canonical_linear), not reduce-scattered over the sequence.
        enable_sequence_parallel=not batch_invariant.is_enabled(),
        spmd_backend=spmd_backend,
    )
    return dims, config


def fill_sharding_plan(spec: ModelSpec, config: ParallelismConfig) -> None:
    """Fill every module config's sharding plan, as torchtitan's Trainer does before building.
    Without it parallelize_fn shards nothing for TP, yet the embedding still does its
    vocab-parallel lookup on the TP group, so logits differ by rank (measured: by 2.0 on the
    tiny model)."""
    spec.model.update_from_config(config=SimpleNamespace(parallelism=config))


def parallelize(
    spec: ModelSpec,
    module: nn.Module,
    dims: ParallelDims,
    config: ParallelismConfig,
    *,
    dtype: str,
    activation_checkpoint: str,
    dump_folder: str,
    compile: bool = False,
) -> nn.Module:
    """The spec's `parallelize_fn` on the meta-device `module`: mixed precision in `dtype`
    (fp32 reductions), `activation_checkpoint` ("none", "full", "selective"), and with
    `compile` torchtitan's per-block torch.compile (trainer/compile.py); FSDP then sums
    gradients over data-parallel ranks instead of averaging them."""
    if compile:
        # Before the blocks are compiled: a graph must see the packed kernel as one op.
        compilable_attention(module)
    module = spec.parallelize_fn(
        module,
        parallel_dims=dims,
        training=TrainingConfig(mixed_precision_param=dtype, mixed_precision_reduce="float32"),
        parallelism=config,
        compile_config=CompileConfig(enable=compile, components=["model"]),
        ac_config=_activation_checkpointing(activation_checkpoint),
        dump_folder=dump_folder,
    )
    disable_fsdp_gradient_division(module)
    platform.enable_fsdp_sum_reduction(module)
    return module


def _activation_checkpointing(mode: str):
    """torchtitan's activation-checkpointing policy for `training.activation_checkpoint`."""
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    return {"none": None, "full": FullAC.Config(), "selective": SelectiveAC.Config()}[mode]
