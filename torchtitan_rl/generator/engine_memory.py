"""A generator's memory: its KV cache's size (bytes a block, blocks in the space given, the
error when one sequence does not fit) and the shared-memory segments of a tensor-parallel
engine on CPU (named per world; a killed run's found and removed).

    .venv/bin/python -m pytest tests/unit -k "kv_space_holds or shared_memory_segments"

Sleep and wake (the weights' memory freed while the trainer trains) are
`LocalGenerator.release_memory` and `reclaim_memory` (engine.py).
"""

import collections
import functools
import os
import re
from pathlib import Path

import torch

from torchtitan_rl import console, platform
from torchtitan_rl.config import GeneratorSection, ModelSection
from torchtitan_rl.models import attention_shape, model_spec


def _kv_cache_error(generator: GeneratorSection, vllm_message: str) -> str:
    """One line for vLLM's "the KV cache cannot hold one max_model_len sequence" error."""
    fits = re.search(r"maximum model length is (\d+)", vllm_message)
    room = f" (it fits {fits.group(1)} tokens)" if fits else ""
    return (
        f"the generator's KV cache cannot hold one sequence of generator.max_model_len = "
        f"{generator.max_model_len} tokens{room}: raise generator.kv_cache_space_gib (CPU) or "
        "generator.gpu_memory_utilization (GPU), raise or unset generator.num_kv_blocks, or "
        "lower generator.max_model_len"
    )


CPU_KV_BLOCK_TOKENS = 128
"""Tokens a KV-cache block holds in vLLM's CPU backend (its default block size there)."""


def kv_block_bytes(model: ModelSection, generator: GeneratorSection) -> int:
    """Bytes of one KV-cache block of this engine: K and V of `CPU_KV_BLOCK_TOKENS` tokens, at
    the generator's dtype, for one tensor-parallel rank's heads, in each layer of one of vLLM's
    KV-cache groups. Layers of one attention kind (full, or a sliding window) form one group;
    mixed kinds (gpt-oss) are split into groups of equal size, which share the blocks' memory
    (vLLM's `_get_kv_cache_groups_uniform_page_size`: the smallest kind's count, or the largest
    one's when it is under 1.5x that)."""
    tp = generator.parallelism.tensor_parallel_degree
    config = model_spec(model.name, model.flavor).model
    pages, kinds = set(), collections.Counter()
    for layer in config.layers:
        if layer.attention is None:  # Gated DeltaNet: a hybrid engine's blocks are vLLM's
            continue
        shape = attention_shape(layer.attention, config.dim)
        # Values are padded to the key width (PagedAttention): K and V pages are alike.
        pages.add(2 * (shape.kv_heads // tp) * shape.head_dim)
        kinds[getattr(layer.attention, "sliding_window_size", None)] += 1
    (per_token,) = pages  # one page size for every layer, as vLLM's grouping assumes
    group = min(kinds.values())
    if max(kinds.values()) < 1.5 * group:
        group = max(kinds.values())
    return per_token * group * CPU_KV_BLOCK_TOKENS * getattr(torch, generator.dtype).itemsize


def kv_blocks(model: ModelSection, generator: GeneratorSection) -> int | None:
    """The engine's KV-cache block count: generator.num_kv_blocks, capped on CPU at what
    generator.kv_cache_space_gib holds (vLLM's override alone would allocate every block it
    names, whatever the space: 512 blocks of the debugmodel are 4 GiB); None: vLLM's own."""
    blocks = generator.num_kv_blocks
    if blocks is None or platform.device_type() != "cpu":
        return blocks
    size = kv_block_bytes(model, generator)
    room = generator.kv_cache_space_gib * 2**30 // size
    if blocks > room:
        _note_kv_capped(blocks, room, size, generator.kv_cache_space_gib)
    return min(blocks, room)


@functools.cache
def _note_kv_capped(blocks: int, room: int, size: int, space: int) -> None:
    console.warn(
        f"note: generator.num_kv_blocks = {blocks} blocks of {size / 2**20:g} MiB would take "
        f"{blocks * size / 2**30:g} GiB; generator.kv_cache_space_gib = {space} holds {room}: "
        f"the KV cache has {room} blocks"
    )


def _kv_cache_bytes(worker) -> int:
    """Each KV-cache storage once: layers of different KV-cache groups share one (gpt-oss)."""
    caches = worker.model_runner.kv_caches
    return sum(
        {c.untyped_storage().data_ptr(): c.untyped_storage().nbytes() for c in caches}.values()
    )


SHARED_MEMORY = Path("/dev/shm")


def _shared_memory_segments() -> set[Path]:
    """vLLM's CPU shared-memory segments for TP collectives (`*-cpushm_<rank>`)."""
    return set(SHARED_MEMORY.glob("*cpushm_*")) if SHARED_MEMORY.is_dir() else set()


_tp_engines_started = 0
"""Tensor-parallel engines this process has started (every rank of a world starts them in
the same order)."""


def _name_segments_by_world() -> None:
    """Prefix vLLM's CPU shared-memory group names with this world's MASTER_PORT and the
    engine's number in this process. vLLM names them from the init method ("env://" under its
    external launcher) and the group's ranks alone, so two worlds on one host (two runs, or
    the engines of a disaggregated run, each in a world of its own), or two engines one after
    the other in one process (whose segments stay mapped until it exits), would make the same
    "-tp:0-[0-1]-cpushm_0" and the second fail ("create shm in SHMManager failed. errno: 17").
    Every rank of a world shares its port, and two worlds on a host cannot."""
    from vllm.distributed.device_communicators import cpu_communicator

    global _tp_engines_started
    _tp_engines_started += 1
    shm = cpu_communicator._CPUSHMDistributed
    if getattr(shm, "_named_by_world", False):
        return
    vllm_name = shm.make_group_name

    def make_group_name(communicator) -> str:
        # vLLM's name starts with the init method's "//", which shm_open drops; a slash
        # inside the name it refuses (measured: errno 22).
        world = f"{os.environ.get('MASTER_PORT', '')}.{_tp_engines_started}"
        return f"{world}{vllm_name(communicator).lstrip('/')}"

    shm.make_group_name = staticmethod(make_group_name)
    shm._named_by_world = True


def _mapped_segments(proc: Path = Path("/proc")) -> set[Path]:
    """The segments of `_shared_memory_segments` that a live process maps (its /proc/PID/maps
    names the file; a process not ours to read counts as mapping nothing)."""
    mapped = set()
    for maps in proc.glob("[0-9]*/maps"):
        try:
            lines = maps.read_text().splitlines()
        except OSError:  # ended meanwhile, or another user's
            continue
        for line in lines:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and "cpushm_" in fields[5]:
                mapped.add(Path(fields[5]))
    return mapped


def remove_stale_segments() -> list[Path]:
    """Remove the CPU TP segments no live process maps: those of a killed run (a TP engine
    removes its own at exit, `platform.at_exit`). They would hold shared memory until reboot,
    and one named like the next engine's (the same torchrun port) makes it fail ("create shm
    in SHMManager failed. errno: 17", measured on the resume after a killed run, before the
    names carried the port). Returns what it removed."""
    stale = sorted(_shared_memory_segments() - _mapped_segments())
    for segment in stale:
        segment.unlink(missing_ok=True)  # the engine's other ranks remove them too
    return stale
