"""How the policy trains: the [training], [parallelism], [sft] and [lora] sections.

    .venv/bin/python -m pytest tests/unit/test_config.py tests/unit/test_lora.py

The policy trainer reads training, parallelism and lora; the SFT loop (torchtitan_rl.sft)
reads sft instead of the RL fields of training.
"""

from dataclasses import dataclass
from typing import Literal

from torchtitan_rl.config.errors import ConfigError, first_change, require


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
    head_chunk_mib: int = 0
    """Memory budget of one chunk of the fused LM head, in MiB of fp32 logits [C, V]: each
    chunk projects C tokens onto the vocabulary (C = budget / (4 V), at most 4,096), forward
    and again in backward. Larger chunks run larger GEMMs (faster on a GPU) and hold more
    memory. 0: the platform's default (256 MiB on CPU, 1,024 MiB on CUDA: 441 and 1,766
    tokens at Qwen3's 151,936-entry vocabulary)."""
    max_prompt_len: int = 64
    """Longest prompt in tokens; longer prompts are an error."""
    expert_bias_update_rate: float = 0.0
    """DeepSeek-V3's auxiliary-loss-free load balancing, as torchtitan trains it: before each
    optimizer step every MoE router's correction bias (`e_score_correction_bias`, which only
    chooses experts) moves by this much per expert toward equal token loads
    (rate x sign(mean load - load), centred), and weight sync carries it. 0: the bias stays the
    checkpoint's (docs/moe.md). For families whose HF checkpoints keep the bias (deepseek_v3,
    kimi_k2_7); torchtitan's default is 1e-3."""
    activation_checkpoint: Literal["none", "full", "selective"] = "none"
    """torchtitan activation checkpointing of each transformer block: none keeps every
    activation for backward; full recomputes the block in backward (least memory, about one
    more forward); selective saves the outputs of matmuls and attention and recomputes the
    rest."""
    compile: bool = False
    """torchtitan's per-block torch.compile (inductor, each transformer block one graph), as
    torchtitan's own trainer offers, for the policy and the frozen reference and distill
    teacher. The packed attention runs as one opaque op in the graph, so new packings do not
    recompile (trainer/compile.py). The first steps pay the compile (seconds to minutes);
    refused with batch_invariant = true."""

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
            require(value >= 1, f"training.{name} = {value}: must be >= 1")
        require(
            self.micro_batch_tokens >= 0,
            f"training.micro_batch_tokens = {self.micro_batch_tokens}: must be >= 0 "
            "(0 trains right-padded rows)",
        )
        require(
            self.micro_batch_tokens == 0 or self.micro_batches == 1,
            f"training.micro_batches = {self.micro_batches} would be ignored: packing under "
            f"training.micro_batch_tokens = {self.micro_batch_tokens} decides the micro-batches; "
            "lower micro_batch_tokens for smaller ones, or set it to 0 to split by row count",
        )
        require(self.lr > 0, f"training.lr = {self.lr}: the learning rate must be > 0, e.g. 1e-5")
        require(
            self.warmup_steps >= 0, f"training.warmup_steps = {self.warmup_steps}: must be >= 0"
        )
        require(
            self.weight_decay >= 0, f"training.weight_decay = {self.weight_decay}: must be >= 0"
        )
        require(
            self.expert_bias_update_rate >= 0,
            f"training.expert_bias_update_rate = {self.expert_bias_update_rate}: must be >= 0 "
            "(0 keeps the routers' bias)",
        )
        require(
            self.head_chunk_mib >= 0,
            f"training.head_chunk_mib = {self.head_chunk_mib}: must be >= 0 (0: the "
            "platform's default)",
        )
        require(
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
    ep: int = 1
    """Trainer expert-parallel degree (mixture-of-experts models): each rank holds 1/ep of
    every MoE layer's experts and trades routed tokens by all-to-all. torchtitan's EP: it
    spans ep of the dp_shard * tp ranks, which must be a multiple of it."""

    def validate(self, world_size: int) -> None:
        for name in ("dp_replicate", "tp", "ep"):
            value = getattr(self, name)
            require(value >= 1, f"parallelism.{name} = {value}: must be >= 1")
        require(
            self.dp_shard >= 1 or self.dp_shard == -1,
            f"parallelism.dp_shard = {self.dp_shard}: must be >= 1, or -1 to fill the world",
        )
        fixed = self.dp_replicate * self.tp
        if self.dp_shard == -1:
            require(
                world_size % fixed == 0,
                f"parallelism.dp_replicate * parallelism.tp = {fixed} does not divide the world "
                f"size {world_size}: change them or launch a multiple of {fixed} processes",
            )
        else:
            require(
                fixed * self.dp_shard == world_size,
                f"parallelism.dp_replicate * dp_shard * tp = {fixed * self.dp_shard} but the world "
                f"size is {world_size}: set parallelism.dp_shard = -1 or launch "
                f"{fixed * self.dp_shard} processes",
            )

        shard_ranks = self.resolved_dp_shard(world_size) * self.tp
        require(
            shard_ranks % self.ep == 0,
            f"parallelism.ep = {self.ep} does not divide the {shard_ranks} ranks of "
            "parallelism.dp_shard * tp: pick an ep that divides them",
        )

    def resolved_dp_shard(self, world_size: int) -> int:
        """dp_shard with -1 replaced by the degree the world size leaves."""
        if self.dp_shard != -1:
            return self.dp_shard
        return world_size // (self.dp_replicate * self.tp)


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
            require(getattr(self, name) >= 1, f"sft.{name} = {getattr(self, name)}: must be >= 1")
        require(
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
    the output layer (tied to the embedding in the small Qwen3 models). A mixture-of-experts
    model's experts and routers stay frozen: `all` adapts its attention, `mlp` is refused."""

    def validate(self) -> None:
        if not self.enable:
            changed = first_change(self, LoRASection(), "lora")
            if changed is not None:
                raise ConfigError(
                    f"{changed[0]} = {changed[1]!r} does nothing while lora.enable = false: "
                    "set lora.enable = true, or remove it"
                )
            return
        require(self.rank >= 1, f"lora.rank = {self.rank}: must be >= 1, e.g. 8")
        require(self.alpha > 0, f"lora.alpha = {self.alpha}: must be > 0, e.g. 2 * lora.rank")


def refuse_windowed(name: str, windows: list[int | None]) -> None:
    """One line when any of the attention layers' `windows` is a sliding window (gpt-oss's,
    Muse Glimmer's): those layers (and gpt-oss's sinks, which torchtitan passes as a closure)
    run per document on the host tuple of starts inside the block, which cannot be one
    tensor-only op. Checked at config validation (the model's name) and at build."""
    windowed = sum(window is not None for window in windows)
    if windowed:
        raise ConfigError(
            f"training.compile = true: {name}'s {windowed} sliding-window attention layers (of "
            f"{len(windows)}) run each packed row per document from host offsets, which a "
            "compiled block would trace anew at every new packing (then run eager past "
            "Dynamo's recompile limit); set training.compile = false for this model"
        )
