"""The [job] and [model] sections: where a run writes, its seed, and the model it trains.

    .venv/bin/python -m pytest tests/unit/test_config.py tests/unit/test_bad_inputs.py

The model's directories are checked here; its weights load when the trainer is built.
"""

import os
from dataclasses import dataclass
from typing import Literal

from torchtitan_rl.config.errors import require

# What the watchdog needs after a phase overruns to dump every rank's stacks and exit
# (watchdog.DUMP_WAIT_S, polls), before a collective's own timeout fires.
COLLECTIVE_MARGIN_S = 60.0


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
    """A class 'module:Class' of loop.Hooks (a scheduler, a logger), built with the
    JobConfig and called before and after each step's stages; None: no hooks."""
    phase_timeout_s: float = 1800.0
    """The longest any phase of a step (generate, train, weight_sync, eval, checkpoint) may run
    on any rank before the watchdog stops the run: every rank's Python stacks go to its run
    log, one line names the step, the phase and the ranks stuck in it, exit code 124
    (torchtitan_rl/watchdog.py). 30 min: ten times what a phase of a large run takes (a step's
    generation, a full checkpoint); 0 turns the watchdog off."""
    collective_timeout_s: float = 1920.0
    """Timeout of every process group (gloo and NCCL): a collective waiting longer raises.
    At least job.phase_timeout_s + 60 s, so that the watchdog, which names the stuck rank,
    speaks first."""

    def validate(self) -> None:
        require(self.seed >= 0, f"job.seed = {self.seed}: a seed must be >= 0; set job.seed = 0")
        require(
            bool(self.dump_folder.strip()),
            "job.dump_folder is empty: set it to a folder for outputs, e.g. 'outputs/run'",
        )
        require(
            self.hooks is None or self.hooks.count(":") == 1,
            f"job.hooks = {self.hooks!r}: write it as 'module:Class'",
        )
        require(
            self.phase_timeout_s >= 0,
            f"job.phase_timeout_s = {self.phase_timeout_s}: must be >= 0 (0: no watchdog)",
        )
        least = self.phase_timeout_s + COLLECTIVE_MARGIN_S
        require(
            self.collective_timeout_s >= least,
            f"job.collective_timeout_s = {self.collective_timeout_s:g} would end a stuck "
            f"collective before the watchdog (job.phase_timeout_s = {self.phase_timeout_s:g}) "
            f"names the stuck rank: set it to at least {least:g}",
        )


@dataclass(kw_only=True, slots=True)
class ModelSection:
    name: str = "qwen3"
    """torchtitan model family (a module under torchtitan.models): qwen3, llama3, gpt_oss,
    deepseek_v3, kimi_k2_7, muse_glimmer (its text tower) or qwen3_5 (its text models: Gated
    DeltaNet hybrids)."""
    flavor: str = "auto"
    """auto: the shape model.hf_checkpoint's config.json gives (llama3, qwen3 dense and MoE,
    gpt_oss, deepseek_v3, kimi_k2_7: any size; models/from_hf.py), resolved to
    `auto:<folder>`; without a checkpoint (random weights), `tiny`. Or a torchtitan flavor,
    e.g. debugmodel, 0.6B, 30B-A3B (mixture of experts), 20b (gpt_oss), 671B (deepseek_v3),
    moonlight-16B-A3B (kimi_k2_7), 30B (muse_glimmer), 9B and 35B-A3B (qwen3_5); `tiny`,
    `tiny_moe` and `tiny_grouped` are this project's CPU models."""
    hf_checkpoint: str | None = None
    """HF checkpoint directory (config.json + *.safetensors) to start from; None: random init."""
    tokenizer_path: str | None = None
    """Directory with tokenizer.json; None: use model.hf_checkpoint."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Trainer compute dtype (FSDP mixed precision); master weights and grads stay float32."""
    freeze_vision: bool = True
    """A vision-language flavor's vision tower (encoder, adapter, projection) is not trained:
    no gradient, no optimizer state, sent to the generator once. false: trained and synced
    like the rest (refused for a text-only flavor)."""

    def __post_init__(self) -> None:
        if self.hf_checkpoint is not None:  # built in code; TOML and CLI values come later
            self.resolve()

    def resolve(self) -> None:
        """flavor "auto" becomes the checkpoint's derived flavor, or `tiny` for random weights
        (no checkpoint)."""
        from torchtitan_rl.models.from_hf import AUTO, derived_flavor

        if self.flavor == AUTO:
            self.flavor = (
                "tiny" if self.hf_checkpoint is None else derived_flavor(self.hf_checkpoint)
            )

    @property
    def tokenizer_dir(self) -> str | None:
        """Where tokenizer.json lives: model.tokenizer_path, else model.hf_checkpoint."""
        return self.tokenizer_path or self.hf_checkpoint

    def validate(self) -> None:
        from torchtitan_rl.models import FAMILIES, SUPPORTED_MODELS, flavors, refused_parts
        from torchtitan_rl.models.from_hf import AUTO, checkpoint_of

        family = FAMILIES.get(self.name)
        require(
            family is not None,
            f"model.name = {self.name!r} is not a torchtitan language model family: "
            f"use one of {', '.join(SUPPORTED_MODELS)}",
        )
        require(
            not family.refused,
            f"model.name = {self.name!r} is not supported yet: {family.refused}; "
            f"use one of {', '.join(SUPPORTED_MODELS)}",
        )
        known = flavors(self.name)
        require(
            self.flavor != AUTO,
            "model.flavor = 'auto' reads the model's shape from model.hf_checkpoint's "
            f"config.json, which is unset: set model.hf_checkpoint, or name a {self.name} flavor "
            "to start from random weights (tiny, debugmodel, ...)",
        )
        self._validate_checkpoint_paths()
        if checkpoint_of(self.flavor) is not None:
            self._validate_derived()
        require(
            checkpoint_of(self.flavor) is not None or self.flavor in known,
            f"model.flavor = {self.flavor!r} is not a {self.name} flavor: "
            f"use one of {', '.join(known)}",
        )
        refused = refused_parts(self.name, self.flavor)
        require(
            not refused,
            f"model.flavor = {self.flavor!r} {refused}: use a text-only flavor "
            f"({', '.join(f for f in known if not refused_parts(self.name, f))})",
        )
        from torchtitan_rl.models import has_vision_tower

        require(
            self.freeze_vision or has_vision_tower(self.name, self.flavor),
            f"model.freeze_vision = false, but {self.name} {self.flavor!r} has no vision tower: "
            "remove it, or pick a vision-language flavor (muse_glimmer tiny_vl, 30B_mm)",
        )

    def _validate_checkpoint_paths(self) -> None:
        for name in ("hf_checkpoint", "tokenizer_path"):
            path = getattr(self, name)
            require(
                path is None or os.path.isdir(path),
                f"model.{name} = {path!r}: no such directory; "
                "point it at a local HF checkpoint directory (scripts/setup.sh builds assets/)",
            )
        require(
            self.hf_checkpoint is None
            or os.path.isfile(os.path.join(self.hf_checkpoint, "config.json")),
            f"model.hf_checkpoint = {self.hf_checkpoint!r} has no config.json: "
            "point it at an HF checkpoint directory",
        )
        require(
            self.hf_checkpoint is not None or self.tokenizer_path is not None,
            "model.tokenizer_path and model.hf_checkpoint are both unset: "
            "set one of them to a directory with tokenizer.json",
        )

    def _validate_derived(self) -> None:
        """A derived flavor (auto:<folder>): the folder's architecture is model.name's family,
        and its config.json builds (from_hf: one line where a field does not fit, or where
        the family's configs are not read from config.json yet)."""
        from torchtitan_rl.models import FAMILIES, model_spec
        from torchtitan_rl.models.from_hf import checkpoint_of, read_architecture

        folder = checkpoint_of(self.flavor)
        architecture = read_architecture(folder)
        matching = [
            name for name, other in FAMILIES.items() if architecture in other.hf_architectures
        ]
        require(
            architecture is None or self.name in matching,
            f"model.name = {self.name!r}, but {folder}/config.json is a {architecture}: set "
            + (f"model.name = {matching[0]!r}" if matching else "a checkpoint of this family"),
        )
        model_spec(self.name, self.flavor)
