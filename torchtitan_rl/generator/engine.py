"""LocalGenerator: an in-process vLLM LLMEngine serving the torchtitan model, one replica per rank.

    .venv/bin/python -m pytest tests/*/test_generator.py

Logprob semantics: vLLM runs with `logprobs_mode="processed_logprobs"`, so the logprob of each
sampled token is log_softmax(logits / temperature) at that position: the same quantity as
`PolicyTrainer.logprobs` with the same temperature. With top_p < 1 vLLM renormalizes over the
nucleus it sampled from, and the two differ by that renormalization.

This module and the three beside it are the one adapter for vLLM's internals (engine core,
executor, worker, model runner): everything else goes through `LocalGenerator`.
`engine_build.py` makes the EngineArgs and checks what the engine needs before it starts,
`engine_requests.py` makes vLLM's requests and reads their outputs as Samples and Deltas,
`engine_memory.py` sizes the KV cache and handles a CPU tensor-parallel engine's shared-memory
segments. Sleep and wake are `LocalGenerator.release_memory` and `reclaim_memory`, here.
"""

import dataclasses
import functools
import gc
import os
from collections.abc import Sequence

import torch
import torch.nn as nn

from torchtitan_rl import batch_invariant, platform
from torchtitan_rl.config import ConfigError, GeneratorSection, ModelSection
from torchtitan_rl.errors import EngineError
from torchtitan_rl.generator.engine_build import (
    _use_eager_logprob_ranks,
    check_tokenizer_fits,
    compiles,
    engine_args,
)
from torchtitan_rl.generator.engine_memory import (
    _kv_cache_bytes,
    _kv_cache_error,
    _name_segments_by_world,
    _shared_memory_segments,
    remove_stale_segments,
)
from torchtitan_rl.generator.engine_requests import (
    _bind_runner,
    _check_same_requests,
    _delta,
    _each,
    _samples,
    add_request,
    check_images,
    check_prompt,
    run_until_finished,
    vllm_request,
)
from torchtitan_rl.models import checkpoint_stop_ids, model_spec
from torchtitan_rl.trainer.model import read_hf_shapes
from torchtitan_rl.types import Completions, Delta, Images


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
        from vllm import LLMEngine

        _use_eager_logprob_ranks()
        self.config = generator
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
        args = engine_args(generator, model, seed=seed, native=native, compiled=compiled)
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
        images: Sequence[Images | None] | None = None,
    ) -> Completions:
        """Sample `n` completions of each prompt (defaults from `generator.sampling`).

        `seed` makes the samples of request i depend only on (seed, i), not on the batch; a
        sequence gives request i its own first seed, `seed[i]`. `max_tokens` likewise: one
        limit for all, or one per request. `images`: each prompt's (None: a text prompt), for
        a vision-language model.
        """
        from vllm.sampling_params import RequestOutputKind

        sampling = self.config.sampling
        images = _each(images, len(prompt_token_ids))
        for i, prompt in enumerate(prompt_token_ids):
            check_prompt(prompt, f"prompt {i}", self.config)
            if images[i] is not None:
                check_images(prompt, images[i], f"prompt {i}")
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
            vllm_request(
                str(first + i),
                prompt,
                sampling=sampling,
                stop_token_ids=self.stop_token_ids,
                policy_version=self.policy_version,
                n=n or sampling.n,
                temperature=temperature,
                max_tokens=limits[i],
                seed=seeds[i],
                # One output per prompt with all n samples, once they are all done.
                output_kind=RequestOutputKind.FINAL_ONLY,
                images=images[i],
            )
            for i, prompt in enumerate(prompt_token_ids)
        ]
        if self.config.parallelism.tensor_parallel_degree > 1:
            _check_same_requests(requests)
        try:
            finished = run_until_finished(
                self.engine,
                requests,
                first,
                progress,
                keep=lambda output: self._stream_outputs.append(self._delta(output)),
            )
        except Exception as e:  # vLLM's own failure: the run stops with it (errors.EngineError)
            raise EngineError(f"the generator's engine raised {e!r}") from e
        routing = None if self.native else self._wrapper().routing
        return Completions(
            prompts=[list(p) for p in prompt_token_ids],
            samples=[_samples(finished[i], routing) for i in range(len(prompt_token_ids))],
            images=None if all(i is None for i in images) else list(images),
        )

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
        images: Images | None = None,
    ) -> None:
        """Add one sample's request, stepped by `step_outputs` (stream.RequestStream);
        `top_p` and `stop` (strings, beside generator.sampling.stop) as a client asked;
        `images`: the prompt's (None: a text prompt)."""
        from vllm.sampling_params import RequestOutputKind

        check_prompt(prompt_token_ids, f"request {request_id}", self.config)
        if images is not None:
            check_images(prompt_token_ids, images, f"request {request_id}")
        request = vllm_request(
            request_id,
            prompt_token_ids,
            sampling=self.config.sampling,
            stop_token_ids=self.stop_token_ids,
            policy_version=self.policy_version,
            n=1,
            temperature=temperature,
            max_tokens=max_tokens,
            seed=seed,
            output_kind=RequestOutputKind.DELTA,  # each step's new tokens
            top_p=top_p,
            stop=stop,
            images=images,
        )
        try:
            add_request(self.engine, request)
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
        """Refresh what derives from the weights: packed GEMM copies, cached KV blocks, and
        with generator.inflight_kv = "recompute" a vision-language model's cached image
        features. New requests key their images on the policy version (`image_keys`), so
        only the requests in flight, which keep their keys, could read the older tower's
        features; "recompute" has just preempted them all, so none holds features that the
        cache's reset would take away (vLLM's `reset_encoder_cache` warns of that case only)."""
        self.repack_weights()
        self.reset_prefix_cache()
        multimodal = getattr(self._wrapper(), "supports_multimodal", False)
        if self.config.inflight_kv == "recompute" and multimodal:
            core = self.engine.engine_core.engine_core
            core.scheduler.reset_encoder_cache()
            core.model_executor.reset_encoder_cache()

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
