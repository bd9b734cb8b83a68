"""LocalGenerator: an in-process vLLM LLMEngine serving the torchtitan model, one replica per rank.

    .venv/bin/python -m pytest tests/*/test_generator.py

Logprob semantics: vLLM runs with `logprobs_mode="processed_logprobs"`, so the logprob of each
sampled token is log_softmax(logits / temperature) at that position: the same quantity as
`PolicyTrainer.logprobs` with the same temperature. With top_p < 1 vLLM renormalizes over the
nucleus it sampled from, and the two differ by that renormalization.

This module is the one adapter for vLLM's internals (engine core, executor, worker, model
runner): everything else goes through `LocalGenerator`.
"""

import collections
import dataclasses
import functools
import gc
import hashlib
import os
import re
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn as nn

from torchtitan_rl import batch_invariant, console, platform
from torchtitan_rl.config import (
    ConfigError,
    GeneratorSection,
    ModelSection,
    read_json,
    text_fields,
)
from torchtitan_rl.errors import EngineError
from torchtitan_rl.generator.plugin import ARCH, HYBRID_ARCH, HYBRID_HOST_OPS
from torchtitan_rl.generator.routing import RoutingLog
from torchtitan_rl.models import (
    attention_shape,
    checkpoint_stop_ids,
    has_linear_attention,
    model_spec,
)
from torchtitan_rl.tasks.render import read_tokenizer_json
from torchtitan_rl.trainer.model import read_hf_shapes
from torchtitan_rl.types import Completions, Delta, Sample

# vLLM reads these at import: the engine must run inside this process, not a child, and its
# per-step INFO lines (one per prefix-cache reset) would drown the run's own output.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def count_greater_equal(x_NV: torch.Tensor, values_N1: torch.Tensor) -> torch.Tensor:
    """vLLM's `batched_count_greater_than` (a sampled token's rank: how many logprobs of its row
    are >= its own), eager, 256 rows at a time so that no [N, V] mask is made whole (the reason
    vLLM compiles it). The same integers. vLLM's is torch.compile'd: measured 2.0 s of inductor
    compilation in every engine's first step on CPU, for ranks this project never reads."""
    torch._check(x_NV.shape[0] == values_N1.shape[0])
    counts = [
        (x_NV[start : start + 256] >= values_N1[start : start + 256]).sum(-1)
        for start in range(0, x_NV.shape[0], 256)
    ]
    return torch.cat(counts) if counts else x_NV.new_zeros(0, dtype=torch.int64)


def _use_eager_logprob_ranks() -> None:
    from vllm.v1.sample import sampler

    sampler.batched_count_greater_than = count_greater_equal


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


def check_tokenizer_fits(model: ModelSection) -> None:
    """Refuse a tokenizer with ids beyond the checkpoint's vocabulary, before any engine starts."""
    tokens = read_tokenizer_json(model.tokenizer_dir).get_vocab_size()
    config = read_json(model.hf_checkpoint, "config.json", "model.hf_checkpoint")
    vocab = text_fields(config).get("vocab_size")
    if not isinstance(vocab, int):
        raise ConfigError(
            f"model.hf_checkpoint = {model.hf_checkpoint!r}: config.json has no vocab_size: "
            "point it at an HF checkpoint directory, or download config.json again"
        )
    if tokens > vocab:
        raise ConfigError(
            f"model.tokenizer_path: the tokenizer has {tokens} tokens but the checkpoint's "
            f"vocabulary has {vocab}: use the tokenizer the checkpoint was trained with"
        )


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


class LocalGenerator:
    """vLLM engine running `TorchTitanForCausalLM` for `model`, configured by `generator`."""

    def __init__(
        self,
        *,
        generator: GeneratorSection,
        model: ModelSection,
        seed: int = 0,
        native: bool = False,
    ):
        """`native` serves vLLM's own implementation of the checkpoint's architecture instead
        of the torchtitan model (for benchmarks: it cannot be weight-synced)."""
        if model.hf_checkpoint is None:
            raise ConfigError(
                "model.hf_checkpoint is unset: the generator starts from an HF checkpoint; "
                "set it (scripts/setup.sh builds assets/tiny_qwen3)"
            )
        check_tokenizer_fits(model)
        compiled = compiles(generator, model)
        read_hf_shapes(model.hf_checkpoint)  # a damaged file: one line, not vLLM's loader's
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(generator.kv_cache_space_gib)
        from vllm import EngineArgs, LLMEngine

        _use_eager_logprob_ranks()
        self.config = generator
        under_torchrun = "RANK" in os.environ
        tensor_parallel = generator.parallelism.tensor_parallel_degree > 1
        if tensor_parallel and generator.enable_sleep_mode and not platform.vllm_can_sleep():
            raise ConfigError(
                "generator.enable_sleep_mode = true frees the weight tensors on CPU, which a "
                "tensor-parallel generator's sharded parameters do not support yet: set it to "
                "false, or generator.parallelism.tensor_parallel_degree = 1"
            )
        segments_before = set()
        if tensor_parallel and platform.device_type() == "cpu":
            _name_segments_by_world()
            remove_stale_segments()
            segments_before = _shared_memory_segments()
        hybrid = has_linear_attention(model.name, model.flavor)
        overrides = {
            "architectures": [HYBRID_ARCH if hybrid else ARCH],
            "torchtitan_model": model.name,
            "torchtitan_flavor": model.flavor,
            "torchtitan_packed_gemm": generator.cpu_packed_gemm,
            "torchtitan_batch_invariant": batch_invariant.uses_own_kernels(),
            "torchtitan_expert_parallel": generator.parallelism.expert_parallel,
            **_decompressed_attention(model),
            **_text_positions(model),
        }
        args = EngineArgs(
            model=model.hf_checkpoint,
            tokenizer=model.tokenizer_dir,
            dtype=generator.dtype,
            seed=seed,
            max_model_len=generator.max_model_len,
            enforce_eager=not compiled,
            compilation_config=platform.generator_compilation(
                compiled=compiled,
                own_invariant_kernels=batch_invariant.uses_own_kernels() and not native,
                captures_routing=not native and _is_moe(model),
                host_ops=HYBRID_HOST_OPS if hybrid and not native else (),
            ),
            gpu_memory_utilization=generator.gpu_memory_utilization,
            tensor_parallel_size=generator.parallelism.tensor_parallel_degree,
            # Under torchrun every rank (TP group) is its own replica in the torchrun world.
            distributed_executor_backend="external_launcher" if under_torchrun else None,
            hf_overrides={} if native else overrides,
            logprobs_mode="processed_logprobs",
            disable_log_stats=True,  # its per-step Prometheus bookkeeping, unread here
            # A hybrid model's prefix cache would keep its recurrent states per block, which
            # vLLM does only with chunked prefill (its "align" mode), off on CPU (below).
            enable_prefix_caching=not hybrid,
            # The Gated DeltaNet state between steps in fp32 whatever the dtype, as the
            # trainer's recurrence keeps it (vLLM's CPU default on AVX512-BF16 machines only).
            mamba_ssm_cache_dtype="float32" if hybrid else "auto",
            # Measured with vllm-cpu 0.32: a seeded request whose prefill is split over steps
            # crashes ("CPU Generator does not use offset": vLLM rewinds the generator of the
            # sample it discards). Unsplit prefills keep seeds and prefix caching working; the
            # token budget is then at least max_model_len, so every prompt fits in one step.
            enable_chunked_prefill=platform.device_type() != "cpu",
            enable_sleep_mode=generator.enable_sleep_mode and platform.vllm_can_sleep(),
            num_gpu_blocks_override=None if hybrid else kv_blocks(model, generator),
        )
        # vLLM collects garbage five times while it builds (its loader twice, its heap freeze
        # three times), each a full pass over every object the imports made: 1.15 s of a
        # one-step run's start here (cProfile). Collected once and frozen first, those passes
        # see only the engine's own objects; vLLM freezes the heap after its build anyway.
        gc.collect()
        gc.freeze()
        try:
            self.engine = LLMEngine.from_engine_args(args)
        except ValueError as e:
            if "KV cache" not in str(e) and "cache blocks" not in str(e):
                raise
            raise ConfigError(_kv_cache_error(generator, str(e))) from None
        # A TP engine on CPU makes shared-memory segments (`_name_segments_by_world`) that
        # vLLM's teardown would remove, but the process ends without it
        # (platform.exit_process): remove this engine's at exit.
        if tensor_parallel:
            for segment in _shared_memory_segments() - segments_before:
                platform.at_exit(functools.partial(segment.unlink, missing_ok=True))
        # After the engine: vLLM sets this process's threads, which the check runs with.
        self.native = native
        self.compiled = compiled
        """Whether vLLM compiled the model (generator.enforce_eager resolved)."""
        if not native:
            spec = model_spec(model.name, model.flavor)
            batch_invariant.check_kernels(spec.model, generator.dtype)
            self.engine.collective_rpc(_bind_runner)
        self.stop_token_ids = checkpoint_stop_ids(model.hf_checkpoint)
        self._next_request = 0
        self._stream_outputs: list[Delta] = []
        self._streamed: dict[str, int] = {}
        """Per streamed request in flight, its prompt's and sampled tokens' count."""
        self.policy_version = 0
        """Version of the weights the engine samples with (bumped by weight sync)."""

    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        *,
        n: int | None = None,
        temperature: float | None = None,
        max_tokens: int | Sequence[int] | None = None,
        seed: int | Sequence[int] | None = None,
        progress: bool = False,
    ) -> Completions:
        """Sample `n` completions of each prompt (defaults from `generator.sampling`).

        `seed` makes the samples of request i depend only on (seed, i), not on the batch; a
        sequence gives request i its own first seed, `seed[i]`. `max_tokens` likewise: one
        limit for all, or one per request.
        """
        from vllm.sampling_params import RequestOutputKind

        sampling = self.config.sampling
        for i, prompt in enumerate(prompt_token_ids):
            self._check_prompt(prompt, f"prompt {i}")
        first = self._next_request
        self._next_request += len(prompt_token_ids)
        count = len(prompt_token_ids)
        limits = _each(max_tokens or sampling.max_tokens, count)
        if isinstance(seed, int):
            # vLLM seeds the n samples of a request seed, seed + 1, ...: request i takes
            # seeds [seed + i * n, seed + (i + 1) * n), shared with no other sample.
            seeds = [seed + i * (n or sampling.n) for i in range(count)]
        else:
            seeds = _each(seed, count)
        requests = [
            self._request(
                str(first + i),
                prompt,
                n=n or sampling.n,
                temperature=temperature,
                max_tokens=limits[i],
                seed=seeds[i],
                # One output per prompt with all n samples, once they are all done.
                output_kind=RequestOutputKind.FINAL_ONLY,
            )
            for i, prompt in enumerate(prompt_token_ids)
        ]
        if self.config.parallelism.tensor_parallel_degree > 1:
            _check_same_requests(requests)
        try:
            finished = self._run(requests, first, progress)
        except Exception as e:  # vLLM's own failure: the run stops with it (errors.EngineError)
            raise EngineError(f"the generator's engine raised {e!r}") from e
        routing = None if self.native else self._wrapper().routing
        return Completions(
            prompts=[list(p) for p in prompt_token_ids],
            samples=[_samples(finished[i], routing) for i in range(len(prompt_token_ids))],
        )

    def _check_prompt(self, prompt: Sequence[int], what: str) -> None:
        if not prompt:
            raise ValueError(f"{what} has no tokens")
        if len(prompt) >= self.config.max_model_len:
            raise ValueError(
                f"{what} has {len(prompt)} tokens, generator.max_model_len = "
                f"{self.config.max_model_len} leaves no room to generate: raise max_model_len "
                "or shorten the prompt"
            )

    def _request(
        self,
        request_id: str,
        prompt: Sequence[int],
        *,
        n,
        temperature,
        max_tokens,
        seed,
        output_kind,
        top_p: float | None = None,
        stop: Sequence[str] | None = None,
    ) -> tuple:
        """vLLM's (id, prompt, params) of one request. The prompt carries the policy version as
        its cache salt: the prefix cache serves it no KV that other weights computed, even
        while requests of an older version are in flight (stream.py)."""
        from vllm import SamplingParams
        from vllm.inputs.engine import tokens_input

        sampling = self.config.sampling
        stop = list(sampling.stop) + list(stop or [])
        params = SamplingParams(
            n=n,
            temperature=sampling.temperature if temperature is None else temperature,
            top_p=sampling.top_p if top_p is None else top_p,
            max_tokens=max_tokens,
            logprobs=0,  # the sampled token's logprob only
            stop_token_ids=self.stop_token_ids,
            stop=stop or None,
            # Measured: vLLM's per-token Python work was a fifth of generation at 2 tokens
            # per sample. Completions are decoded by the scorer, so vLLM decodes nothing
            # (no text, no logprob token strings) unless stop strings need the text; logprobs
            # come as flat lists.
            detokenize=bool(stop),
            flat_logprobs=True,
            seed=seed,
            output_kind=output_kind,
        )
        salt = f"policy-{self.policy_version}"
        return request_id, tokens_input(list(prompt), cache_salt=salt), params

    def _run(self, requests: list, first: int, progress: bool) -> dict:
        """Add `requests` (id, prompt, params) and step the engine until all are finished;
        their outputs by index (request id - `first`). A stream's requests in flight go on
        meanwhile; their outputs wait for its next `step_outputs`."""
        for request in requests:
            self.engine.add_request(*request)
        finished = {}
        bar = _progress_bar(len(requests)) if progress else None
        mine = {request_id for request_id, *_ in requests}
        while len(finished) < len(requests):
            for output in self.engine.step():
                if output.request_id not in mine:  # a stream's: kept for its next step
                    self._stream_outputs.append(self._delta(output))
                elif output.finished:
                    finished[int(output.request_id) - first] = output
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return finished

    def submit(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        *,
        seed: int,
        max_tokens: int,
        temperature: float | None = None,
        top_p: float | None = None,
        stop: Sequence[str] | None = None,
    ) -> None:
        """Add one sample's request, stepped by `step_outputs` (stream.RequestStream);
        `top_p` and `stop` (strings, beside generator.sampling.stop) as a client asked."""
        from vllm.sampling_params import RequestOutputKind

        self._check_prompt(prompt_token_ids, f"request {request_id}")
        request = self._request(
            request_id,
            prompt_token_ids,
            n=1,
            temperature=temperature,
            max_tokens=max_tokens,
            seed=seed,
            output_kind=RequestOutputKind.DELTA,  # each step's new tokens
            top_p=top_p,
            stop=stop,
        )
        try:
            self.engine.add_request(*request)
        except Exception as e:
            raise EngineError(f"the generator's engine raised {e!r}") from e
        self._streamed[request_id] = len(prompt_token_ids)

    def step_outputs(self) -> list[Delta]:
        """One engine step (after what `generate` stepped for the stream meanwhile): each
        request's new tokens, their logprobs and the version that sampled them."""
        outputs, self._stream_outputs = self._stream_outputs, []
        if not self.engine.has_unfinished_requests():
            return outputs
        try:
            stepped = self.engine.step()
        except Exception as e:
            raise EngineError(f"the generator's engine raised {e!r}") from e
        return outputs + [self._delta(output) for output in stepped]

    def _delta(self, output) -> Delta:
        """A streamed request's step output; at its finish, with its routing (MoE)."""
        delta = _delta(output, self.policy_version)
        self._streamed[delta.request_id] += len(delta.token_ids)
        if delta.finish_reason is not None:
            length = self._streamed.pop(delta.request_id)
            if not self.native and self._wrapper().routing is not None:
                routed = self._wrapper().routing.take(delta.request_id, length)
                delta = dataclasses.replace(delta, routed=routed)
        return delta

    def abort(self, request_ids: list[str]) -> None:
        """Drop requests in flight."""
        self.engine.abort_request(request_ids)
        for request_id in request_ids:
            self._streamed.pop(request_id, None)
            if not self.native and self._wrapper().routing is not None:
                self._wrapper().routing.take(request_id, 0)  # forget what it ran

    def close(self) -> None:
        """End this engine in a process that goes on (the tests run several in one torchrun
        world): its model-parallel groups are destroyed, the torch.distributed world is kept.
        vLLM's own teardown, which runs whenever its engine client is collected, also destroys
        the world's default group (`cleanup_dist_env_and_memory`), and the current engine's
        groups if another engine was built since."""
        from vllm.distributed.parallel_state import destroy_model_parallel

        self.engine.engine_core._finalizer.detach()
        self.engine.engine_core.engine_core.model_executor.shutdown()
        destroy_model_parallel()
        self.engine = None

    def kv_cache_bytes(self) -> int:
        """The memory of this engine's KV cache as allocated (this rank's, tensor parallel)."""
        (total,) = self.engine.collective_rpc(_kv_cache_bytes)
        return total

    def reset_prefix_cache(self) -> None:
        """Drop cached KV blocks after a weight update. Requests in flight follow
        generator.inflight_kv: "recompute" preempts them, and vLLM prefills their prompts and
        tokens again with the new weights; "keep" leaves them their KV (their blocks then stay
        cached, but under the older version's cache salt: `_request`)."""
        recompute = self.config.inflight_kv == "recompute"
        self.engine.reset_prefix_cache(reset_running_requests=recompute)

    def refresh_after_weight_update(self) -> None:
        """Refresh what derives from the weights: packed GEMM copies and cached KV blocks."""
        self.repack_weights()
        self.reset_prefix_cache()

    def repack_weights(self) -> None:
        """Rebuild the packed GEMM copies of the weights (CPU); part of the refresh above."""
        self._wrapper().repack()

    @property
    def weights_dropped(self) -> bool:
        """Whether `release_memory` drops the weights (CPU sleep mode), so that the next
        weight sync must write all of them, not only those a step changed."""
        return self.config.enable_sleep_mode and not platform.vllm_can_sleep()

    def release_memory(self) -> None:
        """With generator.enable_sleep_mode, free the weights' memory while the trainer trains,
        until `reclaim_memory()`; the weight sync that follows rewrites every weight. On GPU:
        vLLM's level-1 sleep (weights offloaded to host memory, KV cache freed). On CPU, where
        vLLM has no sleep mode: the weight tensors and their packed copies are freed."""
        if not self.config.enable_sleep_mode:
            return
        if platform.vllm_can_sleep():
            self.engine.sleep(level=1)
            return
        self._released = {}
        for name, param in self.weights().items():
            self._released[name] = param.shape
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        self._wrapper().drop_packed()
        platform.return_freed_memory()

    def reclaim_memory(self) -> None:
        """Bring the weights' memory back for the weight sync, in place: the same parameter
        objects (and, on GPU, the same addresses), so weight sync's targets stay valid."""
        if not self.config.enable_sleep_mode:
            return
        if platform.vllm_can_sleep():
            self.engine.wake_up()
            return
        for name, param in self.weights().items():
            param.data = torch.empty(self._released[name], dtype=param.dtype, device=param.device)

    def _wrapper(self) -> nn.Module:
        # In-process executors run the worker here, so collective_rpc returns live objects.
        (wrapper,) = self.engine.collective_rpc(lambda worker: worker.model_runner.model)
        return wrapper

    def model(self) -> nn.Module:
        """The torchtitan model inside the engine (this process's replica)."""
        return self._wrapper().model

    def weights(self) -> dict[str, torch.Tensor]:
        """What weight sync writes, by torchtitan FQN: the parameters (tied ones once) and the
        persistent buffers the forward reads (`models.weights`); under tensor parallelism each
        sharded one as a DTensor (of the rank's local shard)."""
        return self._wrapper().weights()


def _check_same_requests(requests: list) -> None:
    """The ranks of a tensor-parallel engine each add their requests and step together, so they
    must add the same ones: raise EngineError naming the first rank whose differ (its ranks would
    otherwise run different batches, and hang or sample garbage)."""
    from vllm.distributed.parallel_state import get_tp_group

    sha = hashlib.sha256()
    for request_id, prompt, params in requests:
        sha.update(repr((request_id, prompt["prompt_token_ids"], params.seed)).encode())
        sha.update(repr((params.n, params.temperature, params.max_tokens)).encode())
    group = get_tp_group()
    digests = platform.all_gather_objects(sha.hexdigest(), group=group.cpu_group)
    differ = [rank for rank, digest in enumerate(digests) if digest != digests[0]]
    if differ:
        raise EngineError(
            f"the ranks of a tensor-parallel generator were given different requests (rank "
            f"{differ[0]} of its group differs from rank 0): its prompts, seeds and environment "
            "replies must not depend on the rank or on timing"
        )


def _kv_cache_bytes(worker) -> int:
    """Each KV-cache storage once: layers of different KV-cache groups share one (gpt-oss)."""
    caches = worker.model_runner.kv_caches
    return sum(
        {c.untyped_storage().data_ptr(): c.untyped_storage().nbytes() for c in caches}.values()
    )


def compiles(generator: GeneratorSection, model: ModelSection) -> bool:
    """Whether the engine compiles its model: generator.enforce_eager, or unset, wherever the
    wrapper compiles (on one rank, or tensor parallel on local shards). Where it cannot, unset
    is one console line naming why and false one ConfigError line."""
    from torchtitan_rl.generator import tensor_parallel

    tp = generator.parallelism.tensor_parallel_degree
    why = tensor_parallel.why_not_local(model_spec(model.name, model.flavor), tp)
    fix = "pick a tensor_parallel_degree that divides it"
    if why and generator.enforce_eager is False:
        raise ConfigError(
            f"generator.enforce_eager = false, but {model.name}/{model.flavor}'s tensor-"
            f"parallel generator cannot compile: {why}, so it runs DTensors, eager; {fix}, "
            "or unset enforce_eager or set it to true"
        )
    if why and generator.enforce_eager is None:
        console.warn(
            f"note: generator: {model.name}/{model.flavor} runs eager on DTensors, not compiled "
            f"on local shards ({why}; measured 0.27-0.46x): {fix}"
        )
    return not why and not generator.enforce_eager


def _decompressed_attention(model: ModelSection) -> dict:
    """hf_overrides for a model with multi-head latent attention (DeepSeek-V3's config.json
    names a `kv_lora_rank`): the wrapper attends over keys and values decompressed per head
    (PagedAttention), so vLLM must size and lay out a plain per-head KV cache, not its MLA
    latent cache (whose CPU block size, 16, its CPU attention cannot use). vLLM takes a model
    for MLA by its `model_type` (and VLLM_MLA_DISABLE, which it caches once an engine has
    started): the wrapper's is its own."""
    config = model_spec(model.name, model.flavor).model
    attention = config.first_attention
    if not hasattr(attention, "kv_lora_rank"):
        return {}
    shape = attention_shape(attention, config.dim)
    return {
        "model_type": "torchtitan",
        "head_dim": shape.head_dim,
        "num_key_value_heads": shape.kv_heads,
    }


def _text_positions(model: ModelSection) -> dict:
    """hf_overrides for a checkpoint whose RoPE names MRoPE sections (Qwen3.5's: positions
    over time, height and width for images and video): the same RoPE without them, which a
    text-only model's positions make equivalent, so that vLLM hands the wrapper one position
    per token (it would otherwise want the wrapper to place image tokens)."""
    rope = text_fields(read_json(model.hf_checkpoint, "config.json", "model.hf_checkpoint"))
    rope = rope.get("rope_parameters") or {}
    if "mrope_section" not in rope:
        return {}
    keep = {k: v for k, v in rope.items() if k not in ("mrope_section", "mrope_interleaved")}
    return {"rope_parameters": keep}


def _is_moe(model: ModelSection) -> bool:
    """Whether the model has MoE layers (whose routing the wrapper captures)."""
    return any(
        getattr(layer, "moe", None) for layer in model_spec(model.name, model.flavor).model.layers
    )


def _bind_runner(worker) -> None:
    """Give the wrapper's routing log the model runner, whose batch names each row's request."""
    model = worker.model_runner.model
    if getattr(model, "routing", None) is not None:
        model.routing.runner = worker.model_runner


def _each(value, count: int) -> list:
    """`value` for each of `count` requests: a sequence as it is, anything else repeated."""
    if isinstance(value, Sequence):
        if len(value) != count:
            raise ValueError(f"{len(value)} values for {count} requests")
        return list(value)
    return [value] * count


def _sampled_logprobs(completion) -> list[float]:
    """The logprob of each token of a completion (vLLM's FlatLogprobs with logprobs=0: one
    entry per position, the sampled token's)."""
    flat = completion.logprobs
    if [flat.token_ids[s] for s in flat.start_indices] != list(completion.token_ids):
        raise RuntimeError("vLLM's logprobs are not those of the sampled tokens")
    return [flat.logprobs[s] for s in flat.start_indices]


def _delta(output, version: int) -> Delta:
    """A DELTA output of a one-sample request, compact (a remote engine pickles it)."""
    completion = output.outputs[0]
    finish = (completion.finish_reason or "length") if output.finished else None
    return Delta(
        output.request_id,
        list(completion.token_ids),
        _sampled_logprobs(completion),
        version,
        finish,
    )


def _samples(output, routing: RoutingLog | None) -> list[Sample]:
    """The request's samples; with `routing` (an MoE generator), each with the experts its
    tokens went to (vLLM runs sample i of a request as the child request "i_{request id}")."""
    samples = []
    length = len(output.prompt_token_ids)
    for completion in output.outputs:
        logprobs = _sampled_logprobs(completion)
        routed = None
        if routing is not None:
            child = output.request_id if len(output.outputs) == 1 else None
            child = child or f"{completion.index}_{output.request_id}"
            routed = routing.take(child, length + len(completion.token_ids))
        samples.append(
            Sample(
                token_ids=list(completion.token_ids),
                logprobs=logprobs,
                finish_reason=completion.finish_reason or "length",
                routed_experts=routed,
            )
        )
    if routing is not None:
        _share_prompt_routing([s.routed_experts for s in samples], length)
    return samples


def _share_prompt_routing(routed: list[torch.Tensor], prompt_length: int) -> None:
    """The samples of one prompt share its tokens: a prompt position one of them ran (the
    others read its KV from the prefix cache) gets its routing in all of them."""
    for a in routed:
        for b in routed:
            missing = b[:prompt_length, 0, 0] < 0
            b[:prompt_length][missing] = a[:prompt_length][missing]


def _progress_bar(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="generate", unit="prompt", leave=False)
