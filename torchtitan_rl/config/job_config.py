"""The JobConfig dataclass tree: the schema of a run. TOML files and the CLI only fill values.

    .venv/bin/python -m torchtitan_rl.train --help

Each section is a dataclass whose fields all have defaults and docstrings (tyro turns them into
`--help`). `validate()` checks values once, after TOML and CLI are merged, and raises
`ConfigError` naming the dotted field, the value and the fix. Only `RLTrainer` sees the whole
`JobConfig`; each component receives its own section.
"""

import os
from dataclasses import dataclass, field
from typing import Literal


class ConfigError(ValueError):
    """A bad config value; the message is one line naming the field and the fix."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


@dataclass(kw_only=True, slots=True)
class JobSection:
    config_file: str | None = None
    """TOML file with the run's values; CLI flags override it."""
    dump_folder: str = "outputs/run"
    """Folder for the resolved config.toml, metrics, checkpoints and exports."""
    seed: int = 0
    """Seed for torch, python and numpy RNGs and the generator's sampling."""
    dry_run: bool = False
    """Parse and validate, print the resolved config as TOML, build nothing, exit 0."""
    verbose: bool = False
    """Show library output (vLLM, torch, warnings) on the console too; by default it goes only
    to {dump_folder}/run.log and the console shows this project's lines and errors."""
    hooks: str | None = None
    """A class 'module:Class' of rl_trainer.Hooks (a scheduler, a logger), built with the
    JobConfig and called before and after each step's stages; None: no hooks."""

    def validate(self) -> None:
        _require(self.seed >= 0, f"job.seed = {self.seed}: a seed must be >= 0; set job.seed = 0")
        _require(
            bool(self.dump_folder.strip()),
            "job.dump_folder is empty: set it to a folder for outputs, e.g. 'outputs/run'",
        )
        _require(
            self.hooks is None or self.hooks.count(":") == 1,
            f"job.hooks = {self.hooks!r}: write it as 'module:Class'",
        )


@dataclass(kw_only=True, slots=True)
class ModelSection:
    name: str = "qwen3"
    """torchtitan model name (a module under torchtitan.models): qwen3 or llama3."""
    flavor: str = "tiny"
    """torchtitan flavor of the model, e.g. debugmodel, 0.6B; `tiny` is this project's CPU model."""
    hf_checkpoint: str | None = None
    """HF checkpoint directory (config.json + *.safetensors) to start from; None: random init."""
    tokenizer_path: str | None = None
    """Directory with tokenizer.json; None: use model.hf_checkpoint."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Trainer compute dtype (FSDP mixed precision); master weights and grads stay float32."""

    @property
    def tokenizer_dir(self) -> str | None:
        """Where tokenizer.json lives: model.tokenizer_path, else model.hf_checkpoint."""
        return self.tokenizer_path or self.hf_checkpoint

    def validate(self) -> None:
        from torchtitan_rl.models import SUPPORTED_MODELS, flavors

        _require(
            self.name in SUPPORTED_MODELS,
            f"model.name = {self.name!r} is not supported: "
            f"use one of {', '.join(SUPPORTED_MODELS)}",
        )
        known = flavors(self.name)
        _require(
            self.flavor in known,
            f"model.flavor = {self.flavor!r} is not a {self.name} flavor: "
            f"use one of {', '.join(known)}",
        )
        for name in ("hf_checkpoint", "tokenizer_path"):
            path = getattr(self, name)
            _require(
                path is None or os.path.isdir(path),
                f"model.{name} = {path!r}: no such directory; "
                "point it at a local HF checkpoint directory (scripts/setup.sh builds assets/)",
            )
        _require(
            self.hf_checkpoint is None
            or os.path.isfile(os.path.join(self.hf_checkpoint, "config.json")),
            f"model.hf_checkpoint = {self.hf_checkpoint!r} has no config.json: "
            "point it at an HF checkpoint directory",
        )
        _require(
            self.hf_checkpoint is not None or self.tokenizer_path is not None,
            "model.tokenizer_path and model.hf_checkpoint are both unset: "
            "set one of them to a directory with tokenizer.json",
        )


@dataclass(kw_only=True, slots=True)
class TrainingSection:
    steps: int = 100
    """Number of RL steps (generate, score, train, sync)."""
    lr: float = 1e-6
    """Peak learning rate of AdamW; 1e-6 suits RL on a pretrained model (the CPU demo, which
    trains a tiny model from a toy start, sets its own)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    warmup_steps: int = 0
    """Linear LR warm-up, in RL steps (training.steps counts them too)."""
    lr_decay: Literal["constant", "linear", "cosine"] = "constant"
    """LR after warm-up: constant at training.lr, or decaying to 0 at training.steps."""
    prompts_per_step: int = 16
    """Prompts per step over all data-parallel ranks; each is sampled generator.sampling.n times."""
    mini_batches: int = 1
    """Optimizer steps per pass over a step's rollouts, each on a disjoint, shuffled
    1/mini_batches of them (PPO mini-batches; veRL ppo_mini_batch_size = the batch / this;
    TRL steps_per_generation). Above 1 the PPO ratio departs from 1 and clipping acts."""
    epochs: int = 1
    """Passes over a step's rollouts (PPO epochs; TRL num_iterations). The weights are synced
    to the generator once per step, after the last pass."""
    micro_batch_tokens: int = 8192
    """Token budget of a packed micro-batch: each rank packs its sequences (each up to its last
    trained token) into rows of at most this many tokens, first-fit decreasing, every
    sequence attending only to itself; the LM head runs only at trained tokens, in chunks.
    As many micro-batches per rank as the rank that needs most; the gradient equals one
    batch's. Must be >= generator.max_model_len. 0: right-padded rows in
    training.micro_batches pieces with full logits (the path before packing)."""
    micro_batches: int = 1
    """Gradient-accumulation micro-batches per rank per optimizer step when
    training.micro_batch_tokens = 0 (same gradient as one batch); packing decides them
    otherwise."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    max_prompt_len: int = 64
    """Longest prompt in tokens; longer prompts are an error."""
    activation_checkpoint: Literal["none", "full", "selective"] = "none"
    """torchtitan activation checkpointing of each transformer block: none keeps every
    activation for backward; full recomputes the block in backward (least memory, about one
    more forward); selective saves the outputs of matmuls and attention and recomputes the
    rest."""

    def validate(self) -> None:
        for name in (
            "steps",
            "prompts_per_step",
            "mini_batches",
            "epochs",
            "micro_batches",
            "max_prompt_len",
        ):
            value = getattr(self, name)
            _require(value >= 1, f"training.{name} = {value}: must be >= 1")
        _require(
            self.micro_batch_tokens >= 0,
            f"training.micro_batch_tokens = {self.micro_batch_tokens}: must be >= 0 "
            "(0 trains right-padded rows)",
        )
        _require(
            self.micro_batch_tokens == 0 or self.micro_batches == 1,
            f"training.micro_batches = {self.micro_batches} would be ignored: packing under "
            f"training.micro_batch_tokens = {self.micro_batch_tokens} decides the micro-batches; "
            "lower micro_batch_tokens for smaller ones, or set it to 0 to split by row count",
        )
        _require(self.lr > 0, f"training.lr = {self.lr}: the learning rate must be > 0, e.g. 1e-5")
        _require(
            self.warmup_steps >= 0, f"training.warmup_steps = {self.warmup_steps}: must be >= 0"
        )
        _require(
            self.weight_decay >= 0, f"training.weight_decay = {self.weight_decay}: must be >= 0"
        )
        _require(
            self.max_grad_norm >= 0,
            f"training.max_grad_norm = {self.max_grad_norm}: must be >= 0 (0 disables clipping)",
        )


@dataclass(kw_only=True, slots=True)
class ParallelismSection:
    dp_replicate: int = 1
    """Trainer data-parallel replicas (HSDP replicate dimension)."""
    dp_shard: int = -1
    """Trainer FSDP shard degree; -1: whatever the world size leaves after dp_replicate and tp."""
    tp: int = 1
    """Trainer tensor-parallel degree."""

    def validate(self, world_size: int) -> None:
        for name in ("dp_replicate", "tp"):
            value = getattr(self, name)
            _require(value >= 1, f"parallelism.{name} = {value}: must be >= 1")
        _require(
            self.dp_shard >= 1 or self.dp_shard == -1,
            f"parallelism.dp_shard = {self.dp_shard}: must be >= 1, or -1 to fill the world",
        )
        fixed = self.dp_replicate * self.tp
        if self.dp_shard == -1:
            _require(
                world_size % fixed == 0,
                f"parallelism.dp_replicate * parallelism.tp = {fixed} does not divide the world "
                f"size {world_size}: change them or launch a multiple of {fixed} processes",
            )
        else:
            _require(
                fixed * self.dp_shard == world_size,
                f"parallelism.dp_replicate * dp_shard * tp = {fixed * self.dp_shard} but the world "
                f"size is {world_size}: set parallelism.dp_shard = -1 or launch "
                f"{fixed * self.dp_shard} processes",
            )

    def resolved_dp_shard(self, world_size: int) -> int:
        """dp_shard with -1 replaced by the degree the world size leaves."""
        if self.dp_shard != -1:
            return self.dp_shard
        return world_size // (self.dp_replicate * self.tp)


@dataclass(kw_only=True, slots=True)
class GeneratorParallelismSection:
    tensor_parallel_degree: int = 1
    """vLLM tensor-parallel degree of one generator replica; replicas = world size / this."""

    def validate(self, world_size: int) -> None:
        tp = self.tensor_parallel_degree
        _require(tp >= 1, f"generator.parallelism.tensor_parallel_degree = {tp}: must be >= 1")
        # The torchtitan-in-vLLM wrapper keeps full weights and head counts; sharding it needs
        # the spec's TP plan on vLLM's TP group, which no machine here can verify yet.
        _require(
            tp == 1,
            f"generator.parallelism.tensor_parallel_degree = {tp}: generator tensor "
            "parallelism is not supported yet; use 1 (one replica per rank)",
        )
        _require(
            world_size % tp == 0,
            f"generator.parallelism.tensor_parallel_degree = {tp} does not divide the world "
            f"size {world_size}: use a divisor of {world_size}",
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
        _require(self.n >= 1, f"generator.sampling.n = {self.n}: must be >= 1")
        _require(
            all(self.stop),
            f"generator.sampling.stop = {self.stop!r}: an empty string would stop at once; "
            "remove it",
        )
        _require(
            self.temperature > 0,
            f"generator.sampling.temperature = {self.temperature}: RL samples from the policy, "
            "so it must be > 0 (1.0 samples the policy as it is)",
        )
        _require(
            0 < self.top_p <= 1,
            f"generator.sampling.top_p = {self.top_p}: must be in (0, 1]; 1.0 disables it",
        )
        _require(
            self.max_tokens >= 1,
            f"generator.sampling.max_tokens = {self.max_tokens}: must be >= 1",
        )


@dataclass(kw_only=True, slots=True)
class GeneratorSection:
    placement: Literal["colocated", "disaggregated"] = "colocated"
    """colocated: every rank trains a shard and holds a generator. disaggregated: the last
    generator.num_ranks ranks of the torchrun world only generate, the others only train;
    weights travel by broadcast in buckets after every optimizer step."""
    num_ranks: int = 1
    """Generator ranks in disaggregated placement (a multiple of the trainer ranks)."""
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
    128 tokens); None: as many as kv_cache_space_gib / gpu_memory_utilization allow. When the
    running sequences outgrow it, vLLM preempts and recomputes some of them."""
    enforce_eager: bool = True
    """Run the engine eagerly (no CUDA graphs / torch.compile)."""
    cpu_packed_gemm: bool = True
    """On CPU, run GEMMs on oneDNN-packed weight copies as vLLM's own models do: ~1.8x faster
    generation for debugmodel-sized models, twice the weight memory, and a repack (~3x a
    memcpy of the weights) in every weight sync. No effect on GPU."""
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
        _require(
            self.max_model_len >= 2,
            f"generator.max_model_len = {self.max_model_len}: must be >= 2",
        )
        _require(
            self.num_kv_blocks is None or self.num_kv_blocks >= 1,
            f"generator.num_kv_blocks = {self.num_kv_blocks}: must be >= 1, or unset",
        )
        _require(
            0 < self.gpu_memory_utilization <= 1,
            f"generator.gpu_memory_utilization = {self.gpu_memory_utilization}: must be in (0, 1]",
        )
        _require(
            self.weight_sync_bucket_mb > 0,
            f"generator.weight_sync_bucket_mb = {self.weight_sync_bucket_mb}: must be > 0",
        )
        _require(
            self.kv_cache_space_gib > 0,
            f"generator.kv_cache_space_gib = {self.kv_cache_space_gib}: must be > 0",
        )
        self.parallelism.validate(world_size)
        self.sampling.validate()


# What algorithm.loss = grpo, dapo or gspo sets where the field is left unset: the clip range
# (low, high), the loss aggregation, and dynamic sampling; each as its paper and TRL use them.
LOSS_PRESETS = {
    "grpo": {
        "clip_eps_low": 0.2,
        "clip_eps_high": 0.2,
        "aggregation": "seq_mean_token_mean",
        "dynamic_sampling": False,
    },
    "dapo": {
        "clip_eps_low": 0.2,
        "clip_eps_high": 0.28,
        "aggregation": "token_mean",
        "dynamic_sampling": True,
    },
    "gspo": {
        "clip_eps_low": 3e-4,
        "clip_eps_high": 4e-4,
        "aggregation": "seq_mean_token_mean",
        "dynamic_sampling": False,
    },
}


@dataclass(kw_only=True, slots=True)
class AlgorithmSection:
    advantage: Literal["grpo", "dr_grpo", "rloo"] = "grpo"
    """Advantage estimator: group mean/std (grpo), group mean only (dr_grpo), leave-one-out."""
    loss: Literal["grpo", "dapo", "gspo"] = "grpo"
    """Policy loss, and the defaults of the fields it leaves unset. grpo: PPO-clipped token
    ratio, clip 0.2/0.2, seq_mean_token_mean (DeepSeekMath). dapo: the same ratio with
    clip-higher 0.2/0.28, token_mean and dynamic sampling (DAPO). gspo: one ratio per sequence,
    clip 3e-4/4e-4, seq_mean_token_mean (GSPO)."""
    aggregation: (
        Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant"] | None
    ) = None
    """How per-token losses add up (veRL's loss_agg_mode): over every sampled token of the
    step (token_mean), per sequence as a token mean or a token sum then over sequences
    (seq_mean_token_mean, seq_mean_token_sum), or over sequences * max_tokens (constant, Dr.
    GRPO). Unset: algorithm.loss's."""
    filter_zero_variance_groups: bool = False
    """Drop groups whose samples all got the same reward (zero advantage) from the loss."""
    dynamic_sampling: bool | None = None
    """DAPO's dynamic sampling: drop groups whose rewards are all equal and generate more
    prompts until each rank has its share of training.prompts_per_step informative groups, for
    at most algorithm.max_generation_rounds rounds (a rank still short trains on fewer groups:
    the rest are masked out of the loss, and counted). Unset: true for loss = dapo."""
    max_generation_rounds: int | None = None
    """Most generation rounds per step with dynamic sampling (1: no extra rounds). Unset: 4
    with dynamic sampling, else 1."""
    clip_eps_low: float | None = None
    """Lower clip range of the importance ratio: 1 - clip_eps_low. Unset: algorithm.loss's."""
    clip_eps_high: float | None = None
    """Upper clip range of the importance ratio: 1 + clip_eps_high. Unset: algorithm.loss's."""
    clip_ratio_c: float = 0.0
    """Dual clip (Ye et al. 2020, veRL's clip_ratio_c): a token with a negative advantage loses
    at most clip_ratio_c * |A|, however large its ratio; 0 disables it, else > 1 (e.g. 3)."""
    kl_beta: float = 0.0
    """Coefficient of the KL penalty to the frozen reference model; 0 builds no reference."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator (Schulman's k1, k2, k3); README 'KL' says which gradient each gives."""
    kl_in_reward: bool = False
    """Apply the KL penalty in the reward instead of the loss (veRL's use_kl_in_reward): each
    sample's reward loses kl_beta * the sum over its tokens of the estimator on the generator's
    logprobs, before advantages. false: kl_beta * the estimator joins the loss per token."""
    offpolicy_correction: Literal["auto", "none", "tis", "mis"] = "auto"
    """Correct the loss for the generator's policy (behaviour) differing from the trainer's
    before the update (old): tis weights each token's loss by old / behaviour truncated to
    [offpolicy_ratio_min, offpolicy_ratio_max]; mis keeps the weight where it lies in that band
    and drops the token (or sequence) where it does not (IcePop). auto: tis when
    algorithm.max_offpolicy_steps >= 1, else none."""
    offpolicy_level: Literal["token", "sequence"] | None = None
    """Ratio of each token, or of each sequence (the product over its tokens). Unset: token."""
    offpolicy_ratio_min: float | None = None
    """Lower bound of the off-policy ratio band (tis truncates to it, mis masks below it).
    Unset: 0 (IcePop uses 0.5)."""
    offpolicy_ratio_max: float | None = None
    """Upper bound of the off-policy ratio band (tis truncates to it, mis masks above it).
    Unset: 2 (IcePop uses 5)."""
    max_offpolicy_steps: int = 0
    """Disaggregated placement: generators may sample with weights up to this many optimizer
    steps old (policy age <= k), generating steps s+1..s+k while the trainer trains step s;
    0 is the synchronous loop. algorithm.offpolicy_correction corrects the loss for it."""
    overlong: Literal["keep", "zero_reward", "mask", "soft_penalty"] = "keep"
    """Completions cut by generator.sampling.max_tokens (finish_reason "length"): keep them
    as scored; give them reward 0; mask them out of the loss (DAPO's overlong filtering; they
    still count in their group's advantages); or soft_penalty: DAPO's overlong reward shaping,
    every sample of length L > max_tokens - overlong_buffer loses
    (L - (max_tokens - overlong_buffer)) / overlong_buffer, up to 1 at max_tokens."""
    overlong_buffer: int | None = None
    """The soft_penalty's buffer in tokens (DAPO's L_cache). Unset: max_tokens // 4."""

    def validate(self, max_tokens: int = 16) -> None:
        """Check the values, then fill the fields left unset from algorithm.loss's preset
        (`max_tokens`: generator.sampling.max_tokens, for the overlong buffer)."""
        if self.overlong == "soft_penalty" and self.overlong_buffer is None:
            self.overlong_buffer = max(1, max_tokens // 4)
        _require(
            self.overlong_buffer is None or self.overlong == "soft_penalty",
            f"algorithm.overlong_buffer = {self.overlong_buffer} has no effect with overlong = "
            f"{self.overlong!r}: set algorithm.overlong = 'soft_penalty', or unset it",
        )
        _require(
            self.overlong_buffer is None or 1 <= self.overlong_buffer <= max_tokens,
            f"algorithm.overlong_buffer = {self.overlong_buffer}: must be in 1.."
            f"generator.sampling.max_tokens = {max_tokens}",
        )
        for name, value in LOSS_PRESETS[self.loss].items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        for name in ("clip_eps_low", "clip_eps_high", "kl_beta"):
            value = getattr(self, name)
            _require(value >= 0, f"algorithm.{name} = {value}: must be >= 0")
        _require(
            self.clip_eps_low < 1,
            f"algorithm.clip_eps_low = {self.clip_eps_low}: must be < 1 (ratios clip at 1 - it)",
        )
        _require(
            self.clip_ratio_c == 0 or self.clip_ratio_c > 1 + self.clip_eps_high,
            f"algorithm.clip_ratio_c = {self.clip_ratio_c}: the dual clip must be above the "
            f"upper clip 1 + clip_eps_high = {1 + self.clip_eps_high}, e.g. 3; or 0 to disable",
        )
        if self.max_generation_rounds is None:
            self.max_generation_rounds = 4 if self.dynamic_sampling else 1
        _require(
            self.max_generation_rounds >= 1,
            f"algorithm.max_generation_rounds = {self.max_generation_rounds}: must be >= 1",
        )
        _require(
            self.max_generation_rounds == 1 or self.dynamic_sampling,
            f"algorithm.max_generation_rounds = {self.max_generation_rounds} has no effect "
            "without dynamic sampling: set algorithm.dynamic_sampling = true, or unset it",
        )
        _require(
            not self.kl_in_reward or self.kl_beta > 0,
            "algorithm.kl_in_reward = true with kl_beta = 0 has no effect: set "
            "algorithm.kl_beta > 0 (e.g. 0.001), or kl_in_reward = false",
        )
        if self.offpolicy_correction == "auto":
            self.offpolicy_correction = "tis" if self.max_offpolicy_steps >= 1 else "none"
        band = {"offpolicy_level": "token", "offpolicy_ratio_min": 0.0, "offpolicy_ratio_max": 2.0}
        for name, default in band.items():
            _require(
                getattr(self, name) is None or self.offpolicy_correction != "none",
                f"algorithm.{name} = {getattr(self, name)!r} has no effect with "
                "offpolicy_correction = 'none': set algorithm.offpolicy_correction to 'tis' "
                "or 'mis', or unset it",
            )
            if getattr(self, name) is None and self.offpolicy_correction != "none":
                setattr(self, name, default)
        _require(
            self.offpolicy_correction == "none"
            or self.offpolicy_ratio_min <= 1 <= self.offpolicy_ratio_max,
            f"algorithm.offpolicy_ratio_min = {self.offpolicy_ratio_min} and "
            f"offpolicy_ratio_max = {self.offpolicy_ratio_max}: the band must contain 1 "
            "(an on-policy token's ratio), e.g. 0.5 and 2",
        )


@dataclass(kw_only=True, slots=True)
class TaskSection:
    name: Literal["echo_digits", "reverse_digits", "dataset", "env"] = "echo_digits"
    """echo_digits ('echo 407:' -> '407'), reverse_digits ('reverse 407:' -> '704'),
    dataset: the rows of task.dataset_path, scored by math-verify, or env: episodes of the
    environment task.env on the rows of task.dataset_path (multi-turn, tools)."""
    num_digits: int = 1
    """Digits per prompt (echo_digits, reverse_digits)."""
    dataset_path: str | None = None
    """A local JSONL, JSON or Parquet file, or a folder of such shards (task.name = dataset)."""
    prompt_key: str = "prompt"
    """The row's prompt string, rendered as the user message."""
    messages_key: str | None = None
    """The row's chat messages ([{"role", "content"}, ...]) instead of a prompt string."""
    answer_key: str = "answer"
    """The row's answer, which the reward compares the completion with."""
    answer_format: Literal["raw", "gsm8k"] = "raw"
    """raw: the answer as it is; gsm8k: what follows '####' in the answer (GSM8K's solutions)."""
    chat_template: bool | None = None
    """Render prompts with the checkpoint's chat template (transformers' apply_chat_template);
    false: the prompt text as is. Unset: the template for task.name = dataset when the
    checkpoint has one, raw text for the toy tasks."""
    system_prompt: str | None = None
    """System message put before each prompt's messages (needs the chat template)."""
    enable_thinking: bool | None = None
    """Passed to the chat template (Qwen3: false renders an empty think block, so the model
    answers without reasoning); unset: the template's default."""
    reward_fn: str | None = None
    """Custom reward `module:function(prompt, completion, answer) -> float`; None: the task's."""
    reward_on_error: Literal["zero", "fail"] = "zero"
    """When the reward function raises or times out: count and log it and give the sample 0,
    or stop."""
    reward_timeout_s: float = 30.0
    """Longest one reward call may take before it counts as failed (reward_on_error); 0
    disables the limit. Interrupts Python code (SIGALRM), so it works in the main thread."""
    env: str | None = None
    """The environment class 'module:Class' (task.name = env), built per episode with
    task.env_kwargs; torchtitan_rl.tasks.env:Calculator is the built-in example (a calc tool
    on the arithmetic rows). See README 'Environments and tools'."""
    env_kwargs: dict[str, bool | int | float | str] = field(default_factory=dict)
    """Keyword arguments of the environment class (a [task.env_kwargs] table)."""
    max_turns: int | None = None
    """Most assistant turns of an episode (task.name = env; unset: 4); an episode still going
    after it ends as truncated."""
    env_timeout_s: float = 30.0
    """Longest one environment reset or step may take (an async step's await is cut); a step
    that times out or raises scores as task.reward_on_error says. 0: no limit."""

    @property
    def turns(self) -> int:
        """Most assistant turns of an episode (1: a single-turn task)."""
        if self.name != "env":
            return 1
        return 4 if self.max_turns is None else self.max_turns

    def validate(self) -> None:
        """Values only; the dataset, its rows and the reward function are checked when the task
        is opened (tasks.open_task), before any model is built."""
        _require(self.num_digits >= 1, f"task.num_digits = {self.num_digits}: must be >= 1")
        _require(
            self.reward_timeout_s >= 0,
            f"task.reward_timeout_s = {self.reward_timeout_s}: must be >= 0 (0: no limit)",
        )
        _require(
            self.name not in ("dataset", "env") or self.dataset_path is not None,
            f"task.name = {self.name!r} needs task.dataset_path: a JSONL, JSON or Parquet file "
            '(or a folder of them) of {"prompt": ..., "answer": ...} rows',
        )
        _require(
            self.dataset_path is None or self.name in ("dataset", "env"),
            f"task.dataset_path is set but task.name = {self.name!r} does not read it: set "
            "task.name = 'dataset', or unset task.dataset_path",
        )
        _require(
            self.name != "env" or self.env is not None,
            "task.name = 'env' needs task.env = 'module:Class', e.g. "
            "'torchtitan_rl.tasks.env:Calculator'",
        )
        for name in ("env", "max_turns"):
            _require(
                getattr(self, name) is None or self.name == "env",
                f"task.{name} = {getattr(self, name)!r} but task.name = {self.name!r} runs "
                "single-turn episodes: set task.name = 'env', or unset it",
            )
        _require(
            not self.env_kwargs or self.name == "env",
            f"task.env_kwargs = {self.env_kwargs!r} but task.name = {self.name!r} builds no "
            "environment: set task.name = 'env', or remove the table",
        )
        _require(
            self.env is None or self.env.count(":") == 1,
            f"task.env = {self.env!r}: write it as 'module:Class'",
        )
        _require(
            self.reward_fn is None or self.name != "env",
            f"task.reward_fn = {self.reward_fn!r}: with task.name = 'env' the environment "
            "gives the rewards (EnvStep.reward); unset task.reward_fn",
        )
        _require(
            self.max_turns is None or self.max_turns >= 1,
            f"task.max_turns = {self.max_turns}: must be >= 1",
        )
        _require(
            self.env_timeout_s >= 0,
            f"task.env_timeout_s = {self.env_timeout_s}: must be >= 0 (0: no limit)",
        )
        _require(
            self.dataset_path is None or os.path.exists(self.dataset_path),
            f"task.dataset_path = {self.dataset_path!r}: no such file or folder",
        )
        _require(
            self.reward_fn is None or self.reward_fn.count(":") == 1,
            f"task.reward_fn = {self.reward_fn!r}: write it as 'module:function'",
        )


@dataclass(kw_only=True, slots=True)
class EvalSection:
    dataset_path: str | None = None
    """Held-out dataset to evaluate on (as task.dataset_path, read with the task's keys, chat
    template and reward); None: no evaluation."""
    interval: int = 0
    """Evaluate every this many steps (and after the last); 0: only at the start and the end."""
    at_start: bool = True
    """Evaluate the starting policy before the first step (not when resuming)."""
    n: int = 1
    """Samples per prompt; eval/accuracy is their mean (mean@n), eval/pass@k for k = 1, 2, 4,
    ... <= n uses the unbiased estimator."""
    temperature: float = 0.0
    """Sampling temperature; 0 is greedy decoding (then n must be 1)."""
    max_tokens: int | None = None
    """Most tokens per completion; unset: generator.sampling.max_tokens."""
    log_samples: int = 4
    """Prompts, completions and rewards of this many prompts written to eval.jsonl each time."""

    def validate(self) -> None:
        for name in ("interval", "log_samples"):
            _require(getattr(self, name) >= 0, f"eval.{name} = {getattr(self, name)}: must be >= 0")
        _require(self.n >= 1, f"eval.n = {self.n}: must be >= 1")
        _require(self.temperature >= 0, f"eval.temperature = {self.temperature}: must be >= 0")
        _require(
            self.temperature > 0 or self.n == 1,
            f"eval.n = {self.n} with eval.temperature = 0: greedy samples are all the same; "
            "set eval.n = 1, or a temperature > 0",
        )
        _require(
            self.max_tokens is None or self.max_tokens >= 1,
            f"eval.max_tokens = {self.max_tokens}: must be >= 1",
        )
        _require(
            self.dataset_path is None or os.path.exists(self.dataset_path),
            f"eval.dataset_path = {self.dataset_path!r}: no such file or folder",
        )


@dataclass(kw_only=True, slots=True)
class CheckpointSection:
    enable: bool = False
    """Save checkpoints to {job.dump_folder}/{checkpoint.folder}."""
    folder: str = "checkpoints"
    """Checkpoint folder, relative to job.dump_folder."""
    interval: int = 50
    """Save every this many steps."""
    keep_latest_k: int = 2
    """Keep this many newest checkpoints; 0 keeps all."""
    resume_from: int | None = None
    """Resume from this step's checkpoint; None: the latest complete one, if any (a run
    restarted with the same command continues where it stopped)."""
    async_mode: Literal["disabled", "async"] = "disabled"
    """async: training goes on while a background thread writes the checkpoint (DCP
    async_save); the checkpoint is published when the write completes."""
    export_hf_at_end: bool = False
    """At the end, write the policy as an HF safetensors folder to {job.dump_folder}/hf
    (loadable by vLLM and transformers); scripts/export_hf.py does it for any checkpoint."""

    def validate(self) -> None:
        _require(
            self.resume_from is None or self.enable,
            f"checkpoint.resume_from = {self.resume_from} needs checkpoint.enable = true",
        )
        _require(
            bool(self.folder.strip()) and not os.path.isabs(self.folder),
            f"checkpoint.folder = {self.folder!r}: must be a folder name relative to "
            "job.dump_folder, e.g. 'checkpoints'",
        )
        _require(self.interval >= 1, f"checkpoint.interval = {self.interval}: must be >= 1")
        _require(
            self.keep_latest_k >= 0,
            f"checkpoint.keep_latest_k = {self.keep_latest_k}: must be >= 0 (0 keeps all)",
        )
        _require(
            self.resume_from is None or self.resume_from >= 0,
            f"checkpoint.resume_from = {self.resume_from}: must be a step >= 0",
        )


@dataclass(kw_only=True, slots=True)
class MetricsSection:
    log_interval: int = 1
    """Print a console line every this many steps (metrics.jsonl gets every step)."""
    enable_tensorboard: bool = False
    """Write TensorBoard event files to {job.dump_folder}/tb."""
    enable_wandb: bool = False
    """Log every metric to Weights & Biases (needs `pip install wandb` and `wandb login`, or
    WANDB_MODE=offline); never required. A resumed run continues the same W&B run."""
    wandb_project: str = "torchtitan_rl"
    """The W&B project the run logs to."""
    rollout_log_interval: int = 10
    """Every this many steps, write a few of rank 0's prompts, completions, rewards and
    per-token logprob diffs to rollouts.jsonl; 0 disables."""

    def validate(self) -> None:
        if self.enable_wandb:
            import importlib.util

            _require(
                importlib.util.find_spec("wandb") is not None,
                "metrics.enable_wandb = true needs the wandb package: pip install wandb, "
                "or set it false",
            )
        _require(
            self.log_interval >= 1, f"metrics.log_interval = {self.log_interval}: must be >= 1"
        )
        _require(
            self.rollout_log_interval >= 0,
            f"metrics.rollout_log_interval = {self.rollout_log_interval}: must be >= 0",
        )


@dataclass(kw_only=True, slots=True)
class SFTSection:
    """Supervised fine-tuning (`python -m torchtitan_rl.sft`): token cross-entropy on the
    assistant tokens of task.dataset_path's rows, rendered as the RL run renders its prompts.
    An RL run refuses values here."""

    batch_size: int = 16
    """Rows per optimizer step over all data-parallel ranks (a row with several assistant
    messages counts once per message)."""
    max_seq_len: int = 256
    """Longest rendered row (prompt + response + stop id) in tokens; a longer row is an error
    naming file:row."""
    micro_batch_tokens: int = 4096
    """Gradient-accumulation budget: each rank packs its rows into micro-batches of at most this
    many tokens (one packed row each, every row attending only to itself: no padding), in as
    many micro-batches as the rank that needs most; the gradient equals one batch's. Must be
    >= sft.max_seq_len."""

    def validate(self) -> None:
        for name in ("batch_size", "max_seq_len", "micro_batch_tokens"):
            _require(getattr(self, name) >= 1, f"sft.{name} = {getattr(self, name)}: must be >= 1")
        _require(
            self.micro_batch_tokens >= self.max_seq_len,
            f"sft.micro_batch_tokens = {self.micro_batch_tokens} cannot hold one row of "
            f"sft.max_seq_len = {self.max_seq_len} tokens: raise it to at least that",
        )


@dataclass(kw_only=True, slots=True)
class LoRASection:
    """LoRA (torchtitan's LoRA converter): the policy trains low-rank adapters on its linear
    layers, the base weights stay frozen and the optimizer holds only the adapters. The
    generator runs the plain model; weight sync writes the merged W + (alpha/rank) B A of the
    adapted linears, HF export writes merged weights."""

    enable: bool = False
    """Train LoRA adapters instead of every weight."""
    rank: int = 8
    """Rank r of each adapter (A: r x in, B: out x r; B starts at zero)."""
    alpha: float = 16.0
    """Scale numerator: the adapter adds (alpha / rank) B A to the weight."""
    target: Literal["attention", "mlp", "all"] = "all"
    """Linears that get adapters: attention (fused wqkv, wo), mlp (w1, w2, w3) or all. Never
    the output layer (tied to the embedding in the small Qwen3 models)."""

    def validate(self) -> None:
        if not self.enable:
            changed = _first_change(self, LoRASection(), "lora")
            if changed is not None:
                raise ConfigError(
                    f"{changed[0]} = {changed[1]!r} does nothing while lora.enable = false: "
                    "set lora.enable = true, or remove it"
                )
            return
        _require(self.rank >= 1, f"lora.rank = {self.rank}: must be >= 1, e.g. 8")
        _require(self.alpha > 0, f"lora.alpha = {self.alpha}: must be > 0, e.g. 2 * lora.rank")


# Advantage estimators that compare samples within a prompt's group.
GROUP_ADVANTAGES = ("grpo", "dr_grpo", "rloo")


@dataclass(kw_only=True, slots=True)
class JobConfig:
    batch_invariant: bool = False
    """Global batch-invariant mode: trainer and generator run batch-invariant kernels, so the
    logprob the generator reports for every sampled token equals the trainer's bit for bit
    (logprob_diff/max = 0). Costs step time (see README); needs model.dtype ==
    generator.dtype and generator.sampling.top_p = 1."""
    batch_invariant_on_mismatch: Literal["fail", "warn"] = "fail"
    """With batch_invariant = true, a step whose trainer and generator logprobs differ
    (logprob_diff/max != 0) stops the run (fail) or prints a warning (warn), naming the step
    and the first differing token: the mode then no longer holds what it promises."""
    job: JobSection = field(default_factory=JobSection)
    model: ModelSection = field(default_factory=ModelSection)
    training: TrainingSection = field(default_factory=TrainingSection)
    parallelism: ParallelismSection = field(default_factory=ParallelismSection)
    generator: GeneratorSection = field(default_factory=GeneratorSection)
    algorithm: AlgorithmSection = field(default_factory=AlgorithmSection)
    task: TaskSection = field(default_factory=TaskSection)
    eval: EvalSection = field(default_factory=EvalSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    sft: SFTSection = field(default_factory=SFTSection)
    lora: LoRASection = field(default_factory=LoRASection)

    def _validate_placement(self, world_size: int) -> int:
        """The number of generator-only ranks: 0 when colocated."""
        k = self.algorithm.max_offpolicy_steps
        _require(k >= 0, f"algorithm.max_offpolicy_steps = {k}: must be >= 0")
        if self.generator.placement == "colocated":
            _require(
                k == 0,
                f"algorithm.max_offpolicy_steps = {k} needs generator.placement = "
                "'disaggregated' (colocated ranks alternate generating and training)",
            )
            return 0
        generators, trainers = self.generator.num_ranks, world_size - self.generator.num_ranks
        _require(
            generators >= 1 and trainers >= 1,
            f"generator.num_ranks = {generators} in a world of {world_size}: disaggregated "
            "placement needs at least one trainer and one generator rank; launch more "
            "processes or lower generator.num_ranks",
        )
        _require(
            generators % trainers == 0,
            f"generator.num_ranks = {generators} is not a multiple of the {trainers} trainer "
            "ranks: each trainer rank takes the rollouts of as many generators as the others",
        )
        return generators

    def _validate_heads(self) -> None:
        from torchtitan_rl.models import model_spec

        tp = self.parallelism.tp
        if tp == 1:
            return
        attention = model_spec(self.model.name, self.model.flavor).model.layers[0].attention
        heads, kv_heads = attention.n_heads, attention.n_kv_heads or attention.n_heads
        _require(
            heads % tp == 0 and kv_heads % tp == 0,
            f"parallelism.tp = {tp} does not divide the {heads} attention heads and {kv_heads} "
            f"KV heads of {self.model.name}/{self.model.flavor}: pick a tp that divides both",
        )

    def _validate_batch_invariant(self) -> None:
        model, generator = self.model.dtype, self.generator.dtype
        _require(
            model == generator,
            f"batch_invariant = true needs the same dtype on both sides, but model.dtype = "
            f"{model!r} and generator.dtype = {generator!r}: set both to 'float32' or both "
            "to 'bfloat16'",
        )
        _require(
            self.generator.sampling.top_p == 1.0,
            f"batch_invariant = true: generator.sampling.top_p = {self.generator.sampling.top_p} "
            "renormalizes the generator's logprobs over the nucleus, which the trainer does not "
            "see: set top_p = 1.0",
        )
        _require(
            self.parallelism.tp == 1,
            f"batch_invariant = true with parallelism.tp = {self.parallelism.tp}: row-parallel "
            "layers add partial products across ranks, which the generator's one-device GEMMs "
            "do not reproduce bit for bit; use parallelism.tp = 1 (FSDP) in this mode",
        )

    @property
    def episode_tokens(self) -> int:
        """Most tokens one sample can sample: generator.sampling.max_tokens per turn, over
        task.max_turns turns within generator.max_model_len (the length the "constant" loss
        normalizer and algorithm.overlong measure against)."""
        most = self.task.turns * self.generator.sampling.max_tokens
        return most if self.task.turns == 1 else min(most, self.generator.max_model_len)

    def validate(self, world_size: int = 1, entry: Literal["train", "sft"] = "train") -> None:
        """Check every section, then the rules that span sections, for `world_size` processes
        of the `entry` point (torchtitan_rl.train or torchtitan_rl.sft)."""
        self.job.validate()
        self.model.validate()
        self.training.validate()
        self.task.validate()
        self.eval.validate()
        self.checkpoint.validate()
        self.metrics.validate()
        self.sft.validate()
        self.lora.validate()
        _require(
            not self.lora.enable or self.model.hf_checkpoint is not None,
            "lora.enable = true trains adapters on frozen weights, but model.hf_checkpoint is "
            "unset (random weights): set model.hf_checkpoint to the model to adapt",
        )
        self._validate_heads()
        if entry == "sft":
            self._validate_sft(world_size)
        else:
            self._validate_rl(world_size)

    def _validate_sft(self, world_size: int) -> None:
        """An SFT run: the fields it uses fit, and those only RL uses keep their defaults (a
        value there would change nothing)."""
        self.parallelism.validate(world_size)
        _require(
            self.task.name == "dataset",
            f"task.name = {self.task.name!r}: SFT trains on the rows of a dataset; set "
            "task.name = 'dataset' and task.dataset_path",
        )
        _unused(self, "batch_invariant", "batch_invariant_on_mismatch", "generator", "algorithm")
        _unused(self.training, "prompts_per_step", "mini_batches", "epochs", "micro_batches")
        _unused(self.training, "max_prompt_len", instead="sft.max_seq_len")
        _unused(self.training, "micro_batch_tokens", instead="sft.micro_batch_tokens")
        _unused(
            self.task,
            "num_digits",
            "answer_format",
            "reward_fn",
            "reward_on_error",
            "reward_timeout_s",
        )
        _unused(self.eval, "n", "temperature", instead="greedy samples of eval.log_samples rows")
        _unused(self.metrics, "rollout_log_interval")
        data_ranks = world_size // self.parallelism.tp
        _require(
            self.sft.batch_size % data_ranks == 0,
            f"sft.batch_size = {self.sft.batch_size} does not split over {data_ranks} "
            f"data-parallel ranks: use a multiple of {data_ranks}",
        )

    def _validate_rl(self, world_size: int) -> None:
        _require(
            self.sft == SFTSection(),
            "the [sft] section is for python -m torchtitan_rl.sft; an RL run does not read it: "
            "remove it from this config",
        )
        generators = self._validate_placement(world_size)
        self.parallelism.validate(world_size - generators)
        self.generator.validate(generators or world_size)
        self.algorithm.validate(self.episode_tokens)
        n = self.generator.sampling.n
        _require(
            self.algorithm.advantage not in GROUP_ADVANTAGES or n >= 2,
            f"generator.sampling.n = {n}: algorithm.advantage = {self.algorithm.advantage!r} "
            "compares samples within a group, so it needs n >= 2",
        )
        if self.batch_invariant:
            self._validate_batch_invariant()
        _require(
            self.eval.dataset_path is None or self.task.name in ("dataset", "env"),
            f"eval.dataset_path is set but task.name = {self.task.name!r}: evaluation reads "
            "its rows like the task's dataset; set task.name = 'dataset', or unset it",
        )
        most_tokens = max(self.generator.sampling.max_tokens, self.eval.max_tokens or 0)
        longest = self.training.max_prompt_len + most_tokens
        _require(
            longest <= self.generator.max_model_len,
            f"training.max_prompt_len + generator.sampling.max_tokens (or eval.max_tokens) = "
            f"{longest} exceeds "
            f"generator.max_model_len = {self.generator.max_model_len}: raise max_model_len "
            "or lower one of them",
        )
        budget = self.training.micro_batch_tokens
        _require(
            budget == 0 or budget >= self.generator.max_model_len,
            f"training.micro_batch_tokens = {budget} cannot hold one sequence of "
            f"generator.max_model_len = {self.generator.max_model_len} tokens: raise it to at "
            "least that (or 0 for right-padded micro-batches)",
        )
        replicas = (generators or world_size) // self.generator.parallelism.tensor_parallel_degree
        _require(
            self.training.prompts_per_step % replicas == 0,
            f"training.prompts_per_step = {self.training.prompts_per_step} does not split over "
            f"{replicas} generator replicas: use a multiple of {replicas}",
        )
        # Each data-parallel trainer rank (a TP group shares one) trains on this many samples.
        data_ranks = (world_size - generators) // self.parallelism.tp
        rows = self.training.prompts_per_step * n // data_ranks
        _require(
            self.training.mini_batches <= rows,
            f"training.mini_batches = {self.training.mini_batches} but each of the {data_ranks} "
            f"data-parallel trainer ranks trains on {rows} samples per step (prompts_per_step * "
            "generator.sampling.n / ranks): lower mini_batches or raise prompts_per_step",
        )


def _unused(section, *names: str, instead: str | None = None) -> None:
    """Refuse a value in fields of `section` (or in the sections they name) that an SFT run
    does not read, naming the first such field."""
    prefix = _SECTION_NAMES.get(type(section).__name__, "")
    default = type(section)()
    for name in names:
        changed = _first_change(getattr(section, name), getattr(default, name), prefix + name)
        if changed is not None:
            dotted, value = changed
            also = f" ({instead} does that here)" if instead else ""
            raise ConfigError(
                f"{dotted} = {value!r}: an SFT run does not use it{also}; remove it from "
                "this config"
            )


def _first_change(value, default, dotted: str) -> tuple[str, object] | None:
    """(dotted name, value) of the first field where `value` differs from `default`."""
    if value == default:
        return None
    if not hasattr(value, "__dataclass_fields__"):
        return dotted, value
    for name in value.__dataclass_fields__:
        changed = _first_change(getattr(value, name), getattr(default, name), f"{dotted}.{name}")
        if changed is not None:
            return changed
    return None


_SECTION_NAMES = {
    "TrainingSection": "training.",
    "TaskSection": "task.",
    "EvalSection": "eval.",
    "MetricsSection": "metrics.",
}
