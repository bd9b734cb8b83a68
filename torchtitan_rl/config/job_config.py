"""JobConfig, the schema of a run: the sections of config/*.py composed, and the rules that span
them. TOML files and the CLI only fill values.

    .venv/bin/python -m torchtitan_rl.train --help

Each section is a dataclass whose fields all have defaults and docstrings (tyro turns them into
`--help`). After TOML and CLI are merged, `resolve()` fills the fields left unset (loss presets,
derived defaults), then `validate()` checks values without changing any and raises
`ConfigError` naming the dotted field, the value and the fix. Only the placement sees the whole
`JobConfig`; each component receives its own section.
"""

import os
from dataclasses import dataclass, field
from typing import Literal

from torchtitan_rl.config.algorithm import AlgorithmSection, compares_group
from torchtitan_rl.config.distill import DistillSection
from torchtitan_rl.config.errors import (
    ConfigError,
    first_change,
    read_json,
    require,
    text_fields,
)
from torchtitan_rl.config.generator import GeneratorSection
from torchtitan_rl.config.job import JobSection, ModelSection
from torchtitan_rl.config.outputs import CheckpointSection, MetricsSection
from torchtitan_rl.config.task import EvalSection, TaskSection
from torchtitan_rl.config.training import (
    LoRASection,
    ParallelismSection,
    SFTSection,
    TrainingSection,
    refuse_windowed,
)
from torchtitan_rl.models.from_hf import AUTO, checkpoint_of, derived_flavor


@dataclass(kw_only=True, slots=True)
class JobConfig:
    batch_invariant: bool = False
    """Global batch-invariant mode: trainer and generator run batch-invariant kernels, so the
    logprob the generator reports for every sampled token equals the trainer's bit for bit
    (logprob_diff/max = 0). Costs step time (docs/batch_invariant.md); needs model.dtype ==
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
    distill: DistillSection = field(default_factory=DistillSection)

    def _validate_placement(self, world_size: int) -> int:
        """The number of generator-only ranks: 0 when colocated."""
        k = self.algorithm.max_offpolicy_steps
        require(k >= 0, f"algorithm.max_offpolicy_steps = {k}: must be >= 0")
        if self.generator.placement == "colocated":
            require(
                k == 0,
                f"algorithm.max_offpolicy_steps = {k} needs generator.placement = "
                "'disaggregated' or 'continuous' (colocated ranks alternate generating and "
                "training)",
            )
            return 0
        generators, trainers = self.generator.num_ranks, world_size - self.generator.num_ranks
        require(
            generators >= 1 and trainers >= 1,
            f"generator.num_ranks = {generators} in a world of {world_size}: "
            f"{self.generator.placement} placement needs at least one trainer and one "
            "generator rank; launch more processes or lower generator.num_ranks",
        )
        require(
            generators % trainers == 0,
            f"generator.num_ranks = {generators} is not a multiple of the {trainers} trainer "
            "ranks: each trainer rank takes the rollouts of as many generators as the others",
        )
        if self.generator.placement == "continuous":
            self._validate_continuous(generators)
        return generators

    def _validate_continuous(self, generators: int) -> None:
        generator, algorithm = self.generator, self.algorithm
        share = self.training.prompts_per_step // generators
        require(
            generator.max_inflight_groups is None or generator.max_inflight_groups >= share,
            f"generator.max_inflight_groups = {generator.max_inflight_groups} is below a "
            f"generator's share of a step ({share} groups): no batch could complete; raise it "
            "or unset it",
        )
        refused = {
            "algorithm.dynamic_sampling = true": algorithm.dynamic_sampling,
            "algorithm.router_replay = true": algorithm.router_replay,
            "generator.verify_weight_sync = true": generator.verify_weight_sync,
            "generator.enable_sleep_mode = true": generator.enable_sleep_mode,
            "generator.parallelism.tensor_parallel_degree > 1": (
                generator.parallelism.tensor_parallel_degree > 1
            ),
        }
        for what, set_ in refused.items():
            require(
                not set_,
                f"{what} is not supported in generator.placement = 'continuous' yet (its "
                "groups stream one by one, and weights change between engine steps): unset it, "
                "or use placement 'disaggregated'",
            )

    def _validate_experts(self) -> None:
        from torchtitan_rl.models import FAMILIES, expert_counts

        rate = self.training.expert_bias_update_rate
        if rate:
            family = FAMILIES[self.model.name]
            keep = ", ".join(name for name, f in FAMILIES.items() if f.hf_router_bias)
            require(
                family.hf_router_bias,
                f"training.expert_bias_update_rate = {rate:g}: {self.model.name}'s HF "
                "checkpoints have no router bias, so the export would lose what it learns: "
                f"set it to 0, or train a family whose checkpoints keep one ({keep})",
            )
        ep = self.parallelism.ep
        generator = self.generator.parallelism
        if (
            ep == 1
            and not rate
            and not self.algorithm.router_replay
            and not self.lora.enable
            and not generator.expert_parallel
        ):
            return
        name = f"{self.model.name}/{self.model.flavor}"
        experts = expert_counts(self.model.name, self.model.flavor)
        if generator.expert_parallel:
            tp = generator.tensor_parallel_degree
            require(
                bool(experts),
                f"generator.parallelism.expert_parallel = true but {name} has no experts (a "
                "dense model): set it to false or pick a mixture-of-experts flavor",
            )
            require(
                all(count % tp == 0 for count in experts),
                f"generator.parallelism.expert_parallel = true: tensor_parallel_degree = {tp} "
                f"does not divide the {max(experts)} experts of {name}: pick one that does",
            )
        require(
            not (experts and self.lora.enable and self.lora.target == "mlp"),
            f"lora.target = 'mlp' adapts no layer of {name}: its MLPs are experts, whose "
            "weights are not linear layers LoRA can wrap; set lora.target = 'attention'",
        )
        require(
            bool(experts) or not rate,
            f"training.expert_bias_update_rate = {rate:g} but {name} has no experts (a dense "
            "model): set it to 0 or pick a mixture-of-experts flavor",
        )
        require(
            bool(experts) or not self.algorithm.router_replay,
            f"algorithm.router_replay = true but {name} has no experts (a dense model): "
            "set it to false or pick a mixture-of-experts flavor",
        )
        if ep == 1:
            return
        require(
            bool(experts),
            f"parallelism.ep = {ep} but {name} has no experts (a dense model): "
            "set parallelism.ep = 1 or pick a mixture-of-experts flavor",
        )
        require(
            all(count % ep == 0 for count in experts),
            f"parallelism.ep = {ep} does not divide the {max(experts)} experts of {name}: "
            "pick an ep that divides them",
        )

    def _validate_linear_attention(self) -> None:
        """Qwen3.5's Gated DeltaNet layers split their key and value heads over the
        tensor-parallel ranks (trainer and generator): each degree must divide both."""
        from torchtitan_rl.models import linear_attention_heads

        heads = linear_attention_heads(self.model.name, self.model.flavor)
        if heads is None:
            return
        key_heads, value_heads = heads
        for field_name, tp in (
            ("parallelism.tp", self.parallelism.tp),
            (
                "generator.parallelism.tensor_parallel_degree",
                self.generator.parallelism.tensor_parallel_degree,
            ),
        ):
            require(
                key_heads % tp == 0 and value_heads % tp == 0,
                f"{field_name} = {tp} does not divide the {key_heads} key heads and "
                f"{value_heads} value heads of {self.model.name}/{self.model.flavor}'s Gated "
                "DeltaNet layers: pick one that divides both",
            )

    def _validate_compile(self) -> None:
        """training.compile: a model with sliding-window (gpt-oss, Muse Glimmer) or sink
        attention layers is refused before launch (trainer/compile.py says why)."""
        if not self.training.compile:
            return
        from torchtitan_rl.models import model_spec

        config = model_spec(self.model.name, self.model.flavor).model
        refuse_windowed(f"{self.model.name}/{self.model.flavor}", _windows(config))

    def _validate_heads(self) -> None:
        from torchtitan_rl.models import attention_shape, model_spec

        degrees = {
            "parallelism.tp": self.parallelism.tp,
            "generator.parallelism.tensor_parallel_degree": (
                self.generator.parallelism.tensor_parallel_degree
            ),
        }
        if set(degrees.values()) == {1}:
            return
        config = model_spec(self.model.name, self.model.flavor).model
        shape = attention_shape(config.first_attention, config.dim)
        heads, kv_heads = shape.heads, shape.kv_heads
        for field_name, tp in degrees.items():
            require(
                heads % tp == 0 and kv_heads % tp == 0,
                f"{field_name} = {tp} does not divide the {heads} attention heads and "
                f"{kv_heads} KV heads of {self.model.name}/{self.model.flavor}: pick one that "
                "divides both",
            )

    def _validate_batch_invariant(self) -> None:
        model, generator = self.model.dtype, self.generator.dtype
        require(
            model == generator,
            f"batch_invariant = true needs the same dtype on both sides, but model.dtype = "
            f"{model!r} and generator.dtype = {generator!r}: set both to 'float32' or both "
            "to 'bfloat16'",
        )
        require(
            self.generator.sampling.top_p == 1.0,
            f"batch_invariant = true: generator.sampling.top_p = {self.generator.sampling.top_p} "
            "renormalizes the generator's logprobs over the nucleus, which the trainer does not "
            "see: set top_p = 1.0",
        )
        if self.parallelism.tp > 1:
            self._validate_invariant_trainer_tp(self.parallelism.tp)
        require(
            not self.training.compile,
            "batch_invariant = true with training.compile = true: inductor fuses and reorders "
            "the trainer's reductions (norms, softmax) and picks its own GEMM kernels, which the "
            "generator's batch-invariant kernels do not reproduce bit for bit; set "
            "training.compile = false in this mode",
        )
        generator_tp = self.generator.parallelism.tensor_parallel_degree
        if generator_tp > 1:
            self._validate_invariant_generator_tp(generator_tp)
        from torchtitan_rl import platform

        if platform.device_type() == "cuda":
            self._validate_invariant_cuda()

    def _validate_invariant_cuda(self) -> None:
        """The mode on CUDA (batch_invariant/flash.py, `platform.enable_batch_invariance`):
        vLLM's flash attention on both sides, which has bf16 and fp16 kernels only and which
        the trainer runs causal from position 0 without a window or narrower values (gpt-oss,
        the one family with sinks, has windowed layers too);
        the trainer's and the generator's ATen ops alike, so no TP side (the canonical
        reduction is this project's CPU kernel) and no grouped GEMM (a mixture of experts'
        rows round by each expert's token count) or Gated DeltaNet layer (fla's kernels in
        the trainer, this project's torch routine in the generator)."""
        from torchtitan_rl.models import (
            attention_shape,
            has_linear_attention,
            has_vision_tower,
            is_mixture_of_experts,
            model_spec,
        )

        at = "batch_invariant = true on CUDA"
        require(
            self.model.dtype in ("bfloat16", "float16"),
            f"{at} runs vLLM's flash attention on both sides, which has bf16 and fp16 kernels "
            f"only, but model.dtype = {self.model.dtype!r}: set model.dtype and "
            "generator.dtype to 'bfloat16'",
        )
        for setting, tp in (
            ("parallelism.tp", self.parallelism.tp),
            (
                "generator.parallelism.tensor_parallel_degree",
                self.generator.parallelism.tensor_parallel_degree,
            ),
        ):
            require(
                tp == 1,
                f"{at} with {setting} = {tp}: the canonical reduction across TP ranks runs on CPU "
                f"only so far; set {setting} = 1",
            )
        name, flavor = self.model.name, self.model.flavor
        config = model_spec(name, flavor).model
        parts = [
            (any(_windows(config)), "sliding-window attention layers"),
            (is_mixture_of_experts(name, flavor), "mixture-of-experts layers"),
            (has_linear_attention(name, flavor), "Gated DeltaNet layers"),
            (has_vision_tower(name, flavor), "a vision tower"),
        ]
        shape = attention_shape(config.first_attention, config.dim)
        parts.append((shape.v_head_dim != shape.head_dim, "value heads narrower than its keys"))
        for has, what in parts:
            require(
                not has,
                f"{at}: {name}/{flavor} has {what}, which do not run on vLLM's batch-invariant "
                "kernels on both sides yet; run it on CPU in this mode, or set "
                "batch_invariant = false",
            )

    def _validate_invariant_trainer_tp(self, tp: int) -> None:
        """A TP trainer under the mode: its row-parallel linears reduce canonically over the
        TP ranks (batch_invariant.canonical_linear on DTensors) and its head runs on the whole
        vocabulary (trainer/logprobs.py `head_weight`); dense decoders only (a mixture of
        experts trains with parallelism.ep)."""
        at = f"parallelism.tp = {tp}"
        self._validate_invariant_tp(at, tp, fix="parallelism.tp = 1 (FSDP)", experts=False)
        require(
            not self.lora.enable,
            f"batch_invariant = true with parallelism.tp = {tp} and lora.enable = true: the "
            "merged adapters' row-parallel linears are not canonical across TP ranks yet; use "
            "parallelism.tp = 1 (FSDP) with LoRA in this mode",
        )

    def _validate_invariant_generator_tp(self, tp: int) -> None:
        """A TP generator under the mode: its row-parallel linears and its experts' down
        projections, split by hidden units, reduce canonically
        (batch_invariant.canonical_linear, models/moe.py `_canonical`), its column-parallel
        ones give the whole layer's columns (`ops.linear`); whole experts over the ranks
        (expert_parallel) add a token's experts in the one-device order
        (generator/tensor_parallel.py `RankExperts`); what is not proven yet is one line
        naming it."""
        from torchtitan_rl.generator import tensor_parallel
        from torchtitan_rl.models import model_spec

        at = f"generator.parallelism.tensor_parallel_degree = {tp}"
        fix = "tensor_parallel_degree = 1 in this mode (a generator replica per rank)"
        self._validate_invariant_tp(at, tp, fix=fix, experts=True)
        why = tensor_parallel.why_not_local(model_spec(self.model.name, self.model.flavor), tp)
        require(
            not why,
            f"batch_invariant = true with {at}: {why}, so the generator would run DTensors, "
            "whose reductions are not canonical; use tensor_parallel_degree = 1 in this mode",
        )

    def _validate_invariant_tp(self, field: str, tp: int, *, fix: str, experts: bool) -> None:
        """A tensor-parallel side under the mode (`field`: the degree's setting): a power of
        two (the canonical slices); with `experts` (the generator's side) a mixture of
        experts, its experts' hidden units split, Qwen3.5's Gated DeltaNet layers, its heads
        split, and a vision tower, its row-parallel layers canonical like the decoder's; on
        the trainer's side none of these (a mixture of experts trains with parallelism.ep;
        torchtitan's DeltaNet module takes its output sharded by sequence, which the
        canonical reduction does not give; a vision tower is not proven there yet)."""
        from torchtitan_rl.models import (
            has_linear_attention,
            has_vision_tower,
            is_mixture_of_experts,
        )

        name, flavor = self.model.name, self.model.flavor
        at = f"batch_invariant = true with {field}"
        require(
            tp & (tp - 1) == 0,
            f"{at}: the canonical reduction splits each row-parallel layer in a power-of-two "
            "number of slices; use 2 (or 4, 8)",
        )
        if experts:  # the generator's side runs each of these
            return
        parts = [
            (has_vision_tower, "a vision tower, not yet bitwise across TP layouts"),
            (
                is_mixture_of_experts,
                "mixture-of-experts layers, whose experts train bitwise with a TP generator "
                "under parallelism.ep, not split by parallelism.tp",
            ),
            (
                has_linear_attention,
                "Gated DeltaNet layers, which torchtitan's plan shards by sequence under TP "
                "(sequence parallelism, off in this mode)",
            ),
        ]
        for has, what in parts:
            require(not has(name, flavor), f"{at}: {name}/{flavor} has {what}; use {fix}")

    def _validate_distill(self) -> None:
        """Every source's learn_from has what it needs; the teacher is a model.name flavor
        with the student's vocabulary and tokenizer (cross-tokenizer distillation is out of
        scope: docs/distillation.md)."""
        for name, source in self.task.named_sources.items():
            at = f"task.sources.{name}" if name else "task"
            require(
                self.distill.enabled or source.learn_from == "reward",
                f"{at}.learn_from = {source.learn_from!r} needs a teacher: set "
                "distill.teacher_checkpoint, or learn_from = 'reward'",
            )
        if not self.distill.enabled:
            return
        algorithm = self.algorithm
        for name, source in self.task.named_sources.items():
            require(
                source.learn_from != "teacher"
                or not (algorithm.dynamic_sampling or algorithm.filter_zero_variance_groups),
                f"{f'task.sources.{name}' if name else 'task'}.learn_from = 'teacher' with "
                "algorithm.dynamic_sampling or filter_zero_variance_groups: they drop groups "
                "whose rewards are equal, which a source learning from the teacher alone still "
                "learns from; set both to false (loss = 'dapo' turns dynamic sampling on), or "
                "learn_from = 'both'",
            )
        from torchtitan_rl.models import flavors, model_spec

        require(
            any(s.learn_from != "reward" for s in self.task.named_sources.values()),
            "distill.teacher_checkpoint is set but every source has learn_from = 'reward': "
            "set learn_from = 'teacher' or 'both' where the teacher should teach, or remove "
            "the [distill] section",
        )
        path, flavor = self.distill.teacher_checkpoint, self.distill.teacher_flavor
        known = flavors(self.model.name)
        require(
            flavor is None or flavor in known or checkpoint_of(flavor) is not None,
            f"distill.teacher_flavor = {flavor!r} is not a {self.model.name} flavor: use one "
            f"of {', '.join(known)}",
        )
        flavor = flavor or self.model.flavor
        student = model_spec(self.model.name, self.model.flavor).model.vocab_size
        teacher_config = read_json(path, "config.json", "distill.teacher_checkpoint")
        teacher = text_fields(teacher_config).get("vocab_size")
        require(
            teacher == student,
            f"distill.teacher_checkpoint = {path!r} has a vocabulary of {teacher} tokens, the "
            f"student ({self.model.name}/{self.model.flavor}) {student}: the teacher must "
            "score the student's token ids, so it needs the same tokenizer and vocabulary "
            "(cross-tokenizer distillation is not supported)",
        )
        teacher_flavor = model_spec(self.model.name, flavor).model.vocab_size
        require(
            teacher_flavor == teacher,
            f"distill.teacher_flavor = {flavor!r} has a vocabulary of {teacher_flavor} tokens "
            f"but distill.teacher_checkpoint = {path!r} has {teacher}: set "
            "distill.teacher_flavor to the flavor the checkpoint was saved from",
        )
        require(
            os.path.isfile(os.path.join(path, "tokenizer.json")),
            f"distill.teacher_checkpoint = {path!r} has no tokenizer.json, so it cannot be "
            "checked against the student's: copy in the tokenizer it was trained with",
        )
        same = _vocabulary(path, "distill.teacher_checkpoint") == _vocabulary(
            self.model.tokenizer_dir, "model.tokenizer_path"
        )
        require(
            same,
            f"distill.teacher_checkpoint = {path!r}: its tokenizer.json maps tokens to ids "
            f"unlike the student's (model.tokenizer_dir = {self.model.tokenizer_dir!r}): the "
            "teacher must share the student's tokenizer (cross-tokenizer distillation is not "
            "supported)",
        )

    @property
    def episode_tokens(self) -> int:
        """Most tokens one sample can sample: generator.sampling.max_tokens per turn, over
        task.max_turns turns within generator.max_model_len (the length the "constant" loss
        normalizer and algorithm.overlong measure against)."""
        turns = self.task.most_turns
        most = turns * self.generator.sampling.max_tokens
        return most if turns == 1 else min(most, self.generator.max_model_len)

    def resolve(self, entry: Literal["train", "sft"] = "train") -> None:
        """Fill the fields left unset with the values they stand for: algorithm.loss's preset
        and the defaults that depend on other fields. An SFT run (`entry` sft) reads no
        [algorithm] and keeps it as it is. Idempotent; validate() expects it done."""
        self.model.resolve()
        distill = self.distill
        if distill.enabled and (
            distill.teacher_flavor == AUTO
            or (distill.teacher_flavor is None and checkpoint_of(self.model.flavor))
        ):
            distill.teacher_flavor = derived_flavor(distill.teacher_checkpoint)
        if entry == "train":
            self.algorithm.resolve(self.episode_tokens)
            for source in self.task.named_sources.values():
                if source.learn_from is None:
                    source.learn_from = "teacher" if self.distill.enabled else "reward"

    def validate(self, world_size: int = 1, entry: Literal["train", "sft"] = "train") -> None:
        """Check every section, then the rules that span sections, for `world_size` processes
        of the `entry` point (torchtitan_rl.train or torchtitan_rl.sft); changes nothing."""
        self.job.validate()
        self.model.validate()
        self.training.validate()
        self.task.validate()
        self.eval.validate()
        self.checkpoint.validate()
        self.metrics.validate()
        self.sft.validate()
        self.lora.validate()
        self.distill.validate()
        require(
            not self.lora.enable or self.model.hf_checkpoint is not None,
            "lora.enable = true trains adapters on frozen weights, but model.hf_checkpoint is "
            "unset (random weights): set model.hf_checkpoint to the model to adapt",
        )
        require(
            not (self.lora.enable and not self.model.freeze_vision),
            "model.freeze_vision = false, but lora.enable = true freezes every weight but the "
            "adapters, the vision tower's too: remove one of them",
        )
        self._validate_linear_attention()
        self._validate_heads()
        self._validate_experts()
        self._validate_compile()
        if entry == "sft":
            self._validate_sft(world_size)
        else:
            self._validate_rl(world_size)

    def _validate_sft(self, world_size: int) -> None:
        """An SFT run: the fields it uses fit, and those only RL uses keep their defaults (a
        value there would change nothing)."""
        self.parallelism.validate(world_size)
        require(
            not self.task.sources,
            "task.sources: an SFT run trains on one dataset; give it task.dataset_path (a "
            "folder of shards reads them all), and keep the mixture for the RL run",
        )
        require(
            self.task.name == "dataset",
            f"task.name = {self.task.name!r}: SFT trains on the rows of a dataset; set "
            "task.name = 'dataset' and task.dataset_path",
        )
        _unused(self, "batch_invariant", "batch_invariant_on_mismatch", "generator", "algorithm")
        _unused(self, "distill")
        _unused(self, "task.learn_from", instead="SFT trains on demonstrations")
        _unused(self, "training.prompts_per_step", "training.mini_batches", "training.epochs")
        _unused(self, "training.micro_batches")
        _unused(self, "training.max_prompt_len", instead="sft.max_seq_len")
        _unused(self, "training.micro_batch_tokens", instead="sft.micro_batch_tokens")
        _unused(self, "task.num_digits", "task.answer_format", "task.reward_fn")
        _unused(self, "task.reward_on_error", "task.reward_timeout_s")
        _unused(
            self, "eval.n", "eval.temperature", instead="greedy samples of eval.log_samples rows"
        )
        _unused(self, "metrics.rollout_log_interval")
        data_ranks = world_size // self.parallelism.tp
        require(
            self.sft.batch_size % data_ranks == 0,
            f"sft.batch_size = {self.sft.batch_size} does not split over {data_ranks} "
            f"data-parallel ranks: use a multiple of {data_ranks}",
        )

    def _validate_rl(self, world_size: int) -> None:
        require(
            self.sft == SFTSection(),
            "the [sft] section is for python -m torchtitan_rl.sft; an RL run does not read it: "
            "remove it from this config",
        )
        generators = self._validate_placement(world_size)
        self.parallelism.validate(world_size - generators)
        self.generator.validate(generators or world_size)
        self.algorithm.validate(self.episode_tokens)
        n = self.generator.sampling.n
        require(
            not compares_group(self.algorithm.advantage) or n >= 2,
            f"generator.sampling.n = {n}: algorithm.advantage = {self.algorithm.advantage!r} "
            "compares samples within a group, so it needs n >= 2",
        )
        if self.batch_invariant:
            self._validate_batch_invariant()
        self._validate_distill()
        require(
            self.eval.dataset_path is None or not self.task.sources,
            "eval.dataset_path is set beside task.sources: each source reads its held-out "
            "rows with its own keys; set task.sources.NAME.eval_dataset_path instead",
        )
        require(
            self.eval.dataset_path is None or self.task.name in ("dataset", "env", "agent"),
            f"eval.dataset_path is set but task.name = {self.task.name!r}: evaluation reads "
            "its rows like the task's dataset; set task.name = 'dataset', or unset it",
        )
        most_tokens = max(self.generator.sampling.max_tokens, self.eval.max_tokens or 0)
        longest = self.training.max_prompt_len + most_tokens
        require(
            longest <= self.generator.max_model_len,
            f"training.max_prompt_len + generator.sampling.max_tokens (or eval.max_tokens) = "
            f"{longest} exceeds "
            f"generator.max_model_len = {self.generator.max_model_len}: raise max_model_len "
            "or lower one of them",
        )
        budget = self.training.micro_batch_tokens
        require(
            budget == 0 or budget >= self.generator.max_model_len,
            f"training.micro_batch_tokens = {budget} cannot hold one sequence of "
            f"generator.max_model_len = {self.generator.max_model_len} tokens: raise it to at "
            "least that (or 0 for right-padded micro-batches)",
        )
        replicas = (generators or world_size) // self.generator.parallelism.tensor_parallel_degree
        require(
            self.training.prompts_per_step % replicas == 0,
            f"training.prompts_per_step = {self.training.prompts_per_step} does not split over "
            f"{replicas} generator replicas: use a multiple of {replicas}",
        )
        generator_tp = self.generator.parallelism.tensor_parallel_degree
        require(
            self.training.prompts_per_step // replicas % generator_tp == 0,
            f"training.prompts_per_step = {self.training.prompts_per_step}: each of the "
            f"{replicas} generator replicas samples {self.training.prompts_per_step // replicas} "
            f"prompts, which its {generator_tp} tensor-parallel ranks cannot share out to train "
            f"on: use a multiple of {replicas * generator_tp}",
        )
        # Each data-parallel trainer rank (a TP group shares one) trains on this many samples.
        data_ranks = (world_size - generators) // self.parallelism.tp
        rows = self.training.prompts_per_step * n // data_ranks
        require(
            self.training.mini_batches <= rows,
            f"training.mini_batches = {self.training.mini_batches} but each of the {data_ranks} "
            f"data-parallel trainer ranks trains on {rows} samples per step (prompts_per_step * "
            "generator.sampling.n / ranks): lower mini_batches or raise prompts_per_step",
        )


def _windows(config) -> list[int | None]:
    """Each decoder layer's sliding window in a model config (None: full attention, or a layer
    without softmax attention)."""
    return [
        getattr(getattr(layer, "attention", None), "sliding_window_size", None)
        for layer in config.layers
    ]


def _vocabulary(folder: str, field: str) -> dict[str, int]:
    """Token -> id of the tokenizer.json in `folder` (the config `field` names it), added
    tokens included; a file `tokenizers` cannot read is a ConfigError naming the field."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(os.path.join(folder, "tokenizer.json")).get_vocab(True)
    except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(
            f"{field} = {folder!r}: tokenizer.json is damaged ({reason}): download it again"
        ) from None


def _unused(config: JobConfig, *dotted_names: str, instead: str | None = None) -> None:
    """Refuse a value in fields of `config` (or in the sections they name) that an SFT run
    does not read, naming the first such field."""
    default = JobConfig()
    for dotted in dotted_names:
        changed = first_change(_get(config, dotted), _get(default, dotted), dotted)
        if changed is not None:
            name, value = changed
            also = f" ({instead} does that here)" if instead else ""
            raise ConfigError(
                f"{name} = {value!r}: an SFT run does not use it{also}; remove it from this config"
            )


def _get(config: JobConfig, dotted: str) -> object:
    """The value of `config` at a dotted field name, e.g. "training.epochs"."""
    value = config
    for name in dotted.split("."):
        value = getattr(value, name)
    return value
