"""The [generator] section (vLLM engine) with its [generator.parallelism] and
[generator.sampling] subsections.

    .venv/bin/python -m pytest tests/unit/test_config.py tests/unit/test_bad_inputs.py
"""

from dataclasses import dataclass, field
from typing import Literal

from torchtitan_rl.config.errors import require


@dataclass(kw_only=True, slots=True)
class GeneratorParallelismSection:
    tensor_parallel_degree: int = 1
    """vLLM tensor-parallel degree of one generator replica; replicas = world size / this.
    Colocated, each group of this many consecutive ranks runs one engine over the model's shards
    (the spec's TP plan): the group samples one share of the prompts, and each of its ranks
    trains on its part of the group's rollouts."""
    expert_parallel: bool = False
    """Mixture-of-experts models: shard the experts whole over the tensor-parallel ranks (each
    rank holds experts / tensor_parallel_degree of them, and tokens travel to their experts)
    instead of sharding every expert's hidden width (the TP plan's default)."""

    def engine_of(self, rank: int, world_size: int) -> tuple[int, int, int]:
        """(engine, rank within it, engines) of a generating `rank` of `world_size`: each
        engine spans tensor_parallel_degree consecutive ranks."""
        engine, engine_rank = divmod(rank, self.tensor_parallel_degree)
        return engine, engine_rank, world_size // self.tensor_parallel_degree

    def validate(self, world_size: int) -> None:
        """`world_size`: the ranks that generate (all, or generator.num_ranks)."""
        tp = self.tensor_parallel_degree
        require(tp >= 1, f"generator.parallelism.tensor_parallel_degree = {tp}: must be >= 1")
        require(
            world_size % tp == 0,
            f"generator.parallelism.tensor_parallel_degree = {tp} does not divide the "
            f"{world_size} generating ranks: use a divisor of {world_size}",
        )
        require(
            tp > 1 or not self.expert_parallel,
            "generator.parallelism.expert_parallel = true shards the experts over the "
            "generator's tensor-parallel ranks, but tensor_parallel_degree = 1: raise it, or "
            "set expert_parallel = false",
        )


@dataclass(kw_only=True, slots=True)
class SamplingSection:
    n: int = 8
    """Samples per prompt (the GRPO group size)."""
    temperature: float = 1.0
    """Sampling temperature; trainer logprobs are computed on logits / temperature too."""
    top_p: float = 1.0
    """Nucleus sampling probability mass, in (0, 1]."""
    max_tokens: int = 16
    """Most tokens generated per sample; a completion cut here has finish_reason "length"
    (algorithm.overlong says what happens to it)."""
    stop: list[str] = field(default_factory=list)
    """Strings that end a completion, besides the checkpoint's stop ids (every eos_token_id of
    its generation_config.json, e.g. Qwen3's <|im_end|> and <|endoftext|>)."""

    def validate(self) -> None:
        require(self.n >= 1, f"generator.sampling.n = {self.n}: must be >= 1")
        require(
            all(self.stop),
            f"generator.sampling.stop = {self.stop!r}: an empty string would stop at once; "
            "remove it",
        )
        require(
            self.temperature > 0,
            f"generator.sampling.temperature = {self.temperature}: RL samples from the policy, "
            "so it must be > 0 (1.0 samples the policy as it is)",
        )
        require(
            0 < self.top_p <= 1,
            f"generator.sampling.top_p = {self.top_p}: must be in (0, 1]; 1.0 disables it",
        )
        require(
            self.max_tokens >= 1,
            f"generator.sampling.max_tokens = {self.max_tokens}: must be >= 1",
        )


@dataclass(kw_only=True, slots=True)
class GeneratorSection:
    placement: Literal["colocated", "disaggregated", "continuous"] = "colocated"
    """colocated: every rank trains a shard and holds a generator. disaggregated: the last
    generator.num_ranks ranks of the torchrun world only generate, the others only train;
    weights travel by broadcast in buckets after every optimizer step. continuous: ranks split
    as disaggregated, but each generator keeps its engine full, admitting groups as others
    finish, and takes new weights between engine steps without draining
    (placements/continuous.py)."""
    num_ranks: int = 1
    """Generator ranks in disaggregated and continuous placement (a multiple of the trainer
    ranks)."""
    max_inflight_groups: int | None = None
    """Continuous placement: the groups a generator rank holds at once, in flight or finished
    and not yet sent (None: twice its share of training.prompts_per_step). More keeps the
    engine fuller through long tails; each group costs its KV and its rollouts' memory."""
    batch_order: Literal["completion", "admission"] = "completion"
    """Continuous placement: a training batch is the first groups to finish ("completion":
    the engine never waits for a straggler, but batches depend on timing), or the next groups
    in the order they were admitted, once all of them finished ("admission": the prompts and
    seeds of the other placements' batches, at the price of waiting for their stragglers)."""
    inflight_kv: Literal["recompute", "keep"] = "recompute"
    """Continuous placement, after a weight update: the KV of the requests in flight is
    recomputed with the new weights (exact: each token's logprob is its version's over its
    whole prefix), or kept (no recompute; tokens after the update see KV of older weights)."""
    double_buffer_weights: bool = True
    """Continuous placement: a thread on each generator rank receives the next policy version
    into a second copy of the weights while the engine generates, copied in between engine
    steps (the trainers' broadcast waits for no engine step; one more copy of the weights in
    memory). false: received between engine steps, straight into the engine's weights."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Generator weight and activation dtype."""
    max_model_len: int = 512
    """Longest prompt + completion the engine accepts (sizes the KV cache)."""
    gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory vLLM may use (CUDA only)."""
    kv_cache_space_gib: int = 1
    """KV-cache size in whole GiB on CPU (VLLM_CPU_KVCACHE_SPACE)."""
    num_kv_blocks: int | None = None
    """Cap the KV cache at this many blocks (vLLM's num_gpu_blocks_override; a CPU block holds
    128 tokens); None: as many as kv_cache_space_gib / gpu_memory_utilization allow. On CPU
    the cap is itself capped at what kv_cache_space_gib holds (said once at start). When the
    running sequences outgrow it, vLLM preempts and recomputes some of them."""
    enforce_eager: bool | None = None
    """Run the engine eagerly (no torch.compile, no CUDA graphs). None: compiled as vLLM runs
    its own models (traced once at warm-up; on CUDA, graphs captured) wherever the generator
    compiles: one rank per engine, or tensor parallel on local shards (the dense models);
    an MoE's tensor-parallel generator runs DTensors, eager, and false is refused for it.
    Compiled and eager give the same tokens (fp32 logprobs within 2e-6, 1e-5 for gpt-oss;
    bitwise under batch-invariant mode); compiling adds seconds to the engine's start."""
    cpu_packed_gemm: bool = True
    """On CPU, run GEMMs on oneDNN-packed weight copies as vLLM's own models do: 1.6-2.0x
    faster generation for debugmodel-sized models (docs/limitations.md), twice the weight
    memory, and a repack (~3x a memcpy of the weights) in every weight sync. Mixture-of-experts
    layers likewise run vLLM's CPU fused-MoE kernel on packed expert weights, and Qwen3.5's
    Gated DeltaNet layers, in bf16, vLLM's CPU kernels (docs/qwen3_5.md). No effect on GPU."""
    weight_sync_bucket_mb: float = 64.0
    """Weight sync gathers and copies parameters in buckets of about this size (peak extra
    memory); a larger parameter forms a bucket of its own."""
    verify_weight_sync: bool = False
    """After each sync, compare a checksum of every synced tensor on both sides (slow)."""
    enable_sleep_mode: bool = False
    """Free the generator's weight memory while the trainer trains, from the end of generation
    to the weight sync (which rewrites every weight): on GPU vLLM's level-1 sleep (weights
    offloaded to host memory, KV cache freed); on CPU, where vLLM has no sleep mode, the weight
    tensors and their packed GEMM copies are freed and re-allocated for the sync."""
    parallelism: GeneratorParallelismSection = field(default_factory=GeneratorParallelismSection)
    sampling: SamplingSection = field(default_factory=SamplingSection)

    def validate(self, world_size: int) -> None:
        require(
            self.max_model_len >= 2,
            f"generator.max_model_len = {self.max_model_len}: must be >= 2",
        )
        require(
            self.num_kv_blocks is None or self.num_kv_blocks >= 1,
            f"generator.num_kv_blocks = {self.num_kv_blocks}: must be >= 1, or unset",
        )
        require(
            0 < self.gpu_memory_utilization <= 1,
            f"generator.gpu_memory_utilization = {self.gpu_memory_utilization}: must be in (0, 1]",
        )
        require(
            self.weight_sync_bucket_mb > 0,
            f"generator.weight_sync_bucket_mb = {self.weight_sync_bucket_mb}: must be > 0",
        )
        require(
            self.kv_cache_space_gib > 0,
            f"generator.kv_cache_space_gib = {self.kv_cache_space_gib}: must be > 0",
        )
        require(
            self.max_inflight_groups is None or self.max_inflight_groups >= 1,
            f"generator.max_inflight_groups = {self.max_inflight_groups}: must be >= 1, or unset",
        )
        continuous = self.placement == "continuous"
        in_flight = (
            self.max_inflight_groups,
            self.inflight_kv,
            self.batch_order,
            self.double_buffer_weights,
        )
        require(
            continuous or in_flight == (None, "recompute", "completion", True),
            "generator.max_inflight_groups, generator.inflight_kv, generator.batch_order and "
            "generator.double_buffer_weights act "
            "only in continuous placement (elsewhere no request is in flight at a weight "
            "update): set generator.placement = 'continuous', or leave them unset",
        )
        self.parallelism.validate(world_size)
        self.sampling.validate()
