"""JobConfig: defaults < TOML < CLI, type checks, validation errors, TOML round trip,
resolve() then validate().

.venv/bin/python -m pytest tests/unit/test_config.py
"""

import copy

import pytest
from helpers.launch import DEBUG_TOML, REPO, TINY, write_toml

from torchtitan_rl.config import (
    AlgorithmSection,
    GeneratorSection,
    JobConfig,
    ModelSection,
    parse_args,
    to_toml,
)

# run_configs name assets/ relative to the repo root, as the README's commands do.
pytestmark = pytest.mark.usefixtures("repo_cwd")


def test_precedence_defaults_toml_cli(tmp_path):
    path = write_toml(
        tmp_path,
        f'[model]\nhf_checkpoint = "{TINY}"\n[training]\nsteps = 5\nlr = 1\n'
        "[generator.sampling]\ntemperature = 0.5\n",
    )
    config = parse_args(["--job.config_file", path, "--training.steps", "9"])
    assert config.training.steps == 9  # CLI beats TOML
    assert config.training.lr == 1.0 and isinstance(config.training.lr, float)  # TOML int
    assert config.generator.sampling.temperature == 0.5  # TOML beats default
    assert config.generator.sampling.n == JobConfig().generator.sampling.n  # default
    assert config.job.config_file == path


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--generator.enforce_eager", "false"], (False, False)),
        (["--generator.enforce_eager", "FALSE", "--job.dry_run", "true"], (False, True)),
        (["--job.dry_run"], (None, True)),  # enforce_eager unset: resolved by the engine
        (["--job.dry_run", "--generator.enforce_eager=True"], (True, True)),
        (["--generator.enforce_eager", "--job.dry_run", "false"], (True, False)),
    ],
)
def test_booleans_take_explicit_values(flags, expected):
    config = parse_args(["--job.config_file", DEBUG_TOML, *flags])
    assert (config.generator.enforce_eager, config.job.dry_run) == expected


def test_debug_config_validates_for_two_processes():
    config = parse_args(["--job.config_file", DEBUG_TOML], world_size=2)
    assert config.parallelism.resolved_dp_shard(2) == 2
    assert config.model.hf_checkpoint == "assets/tiny_qwen3"


def test_gpu_configs_parse(tmp_path):
    # The GPU configs point at checkpoints and GSM8K files the user provides; stand them in.
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "train.parquet").write_bytes(b"")
    for name in ("qwen3_0.6b", "qwen3_1.7b"):
        config = parse_args(
            [
                *("--job.config_file", str(REPO / "run_configs" / f"{name}.toml")),
                *("--model.hf_checkpoint", str(tmp_path)),
                *("--task.dataset_path", str(tmp_path / "train.parquet")),
                *("--eval.dataset_path", str(tmp_path / "train.parquet")),
            ],
            world_size=8,
        )
        assert config.model.flavor in ("0.6B", "1.7B")
        assert config.model.dtype == "bfloat16"
        assert config.task.answer_format == "gsm8k" and config.task.enable_thinking is False


def test_to_toml_round_trips_every_field_in_process(tmp_path):
    config = parse_args(
        [
            "--job.config_file",
            DEBUG_TOML,
            "--algorithm.filter_zero_variance_groups",
            "true",
            "--checkpoint.enable",
            "true",
            "--checkpoint.resume_from",
            "3",
            "--task.num_digits",
            "2",
            "--algorithm.loss",
            "dapo",
        ]
    )
    again = parse_args(["--job.config_file", write_toml(tmp_path, to_toml(config))])
    again.job.config_file = config.job.config_file
    assert again == config


def test_loss_presets_fill_only_the_fields_left_unset():
    dapo = parse_args(["--job.config_file", DEBUG_TOML, "--algorithm.loss", "dapo"]).algorithm
    assert (dapo.clip_eps_low, dapo.clip_eps_high, dapo.aggregation) == (0.2, 0.28, "token_mean")
    assert (dapo.dynamic_sampling, dapo.max_generation_rounds) == (True, 4)
    gspo = parse_args(
        [
            "--job.config_file",
            DEBUG_TOML,
            "--algorithm.loss",
            "gspo",
            "--algorithm.clip_eps_high",
            "1e-3",
        ]
    ).algorithm
    assert (gspo.clip_eps_low, gspo.clip_eps_high) == (3e-4, 1e-3)
    assert (gspo.aggregation, gspo.dynamic_sampling) == ("seq_mean_token_mean", False)
    grpo = parse_args(["--job.config_file", DEBUG_TOML]).algorithm
    assert (grpo.clip_eps_high, grpo.aggregation, grpo.offpolicy_correction) == (
        0.2,
        "seq_mean_token_mean",
        "none",
    )


def test_offpolicy_correction_is_on_by_default_when_off_policy():
    config = parse_args(
        [
            "--job.config_file",
            DEBUG_TOML,
            "--generator.placement",
            "disaggregated",
            "--algorithm.max_offpolicy_steps",
            "2",
        ],
        world_size=2,
    )
    algorithm = config.algorithm
    assert algorithm.offpolicy_correction == "tis"
    assert (algorithm.offpolicy_level, algorithm.offpolicy_ratio_max) == ("token", 2.0)


@pytest.mark.parametrize(
    ("algorithm", "generator", "world_size"),
    [
        (AlgorithmSection(), GeneratorSection(), 1),
        (AlgorithmSection(loss="dapo", overlong="soft_penalty"), GeneratorSection(), 1),
        (
            AlgorithmSection(loss="gspo", max_offpolicy_steps=2, offpolicy_correction="mis"),
            GeneratorSection(placement="disaggregated"),
            2,
        ),
    ],
    ids=["defaults", "dapo preset", "off-policy gspo"],
)
def test_resolve_is_idempotent_and_validate_changes_nothing(algorithm, generator, world_size):
    model = ModelSection(hf_checkpoint=TINY)
    config = JobConfig(model=model, generator=generator, algorithm=algorithm)
    with pytest.raises(ValueError, match="needs resolve"):
        config.validate(world_size)
    config.resolve()
    resolved = copy.deepcopy(config)
    config.resolve()
    assert config == resolved
    config.validate(world_size)
    assert config == resolved
    assert config.algorithm.clip_eps_high is not None
    assert config.algorithm.offpolicy_correction != "auto"


def test_dapo_preset_is_filled_by_resolve():
    config = JobConfig(algorithm=AlgorithmSection(loss="dapo", overlong="soft_penalty"))
    config.resolve()
    algorithm = config.algorithm
    assert (algorithm.clip_eps_high, algorithm.aggregation) == (0.28, "token_mean")
    assert (algorithm.dynamic_sampling, algorithm.max_generation_rounds) == (True, 4)
    assert algorithm.overlong_buffer == config.generator.sampling.max_tokens // 4


@pytest.mark.parametrize(
    ("name", "entry"),
    [("debug_cpu", "train"), ("arith_cpu", "train"), ("sft_arith_cpu", "sft")],
)
def test_run_configs_are_left_unchanged_by_resolve_and_validate(name, entry):
    config = parse_args(
        ["--job.config_file", str(REPO / "run_configs" / f"{name}.toml")], 2, entry=entry
    )
    parsed = copy.deepcopy(config)
    config.resolve(entry)
    config.validate(2, entry)
    assert config == parsed
    if entry == "sft":  # an SFT run reads no [algorithm]: resolve leaves it unset
        assert config.algorithm == AlgorithmSection()


def test_qwen3_5_splits_its_gated_deltanet_heads_over_tensor_parallel_ranks():
    """Every torchtitan family runs now (qwen3_5 last); its Gated DeltaNet layers split their
    key and value heads over the tensor-parallel ranks on either side, so a degree that does
    not divide them is one line naming the field, at config time."""
    from torchtitan_rl.config import ConfigError
    from torchtitan_rl.models import FAMILIES, SUPPORTED_MODELS, linear_attention_heads

    assert set(SUPPORTED_MODELS) == set(FAMILIES)
    assert linear_attention_heads("qwen3_5", "tiny") == (2, 4)
    assert linear_attention_heads("qwen3_5", "35B-A3B") == (16, 32)
    assert linear_attention_heads("qwen3", "tiny") is None
    qwen3_5 = ["--job.config_file", DEBUG_TOML, "--model.name", "qwen3_5"]
    assert parse_args([*qwen3_5, "--model.flavor", "tiny_moe"]).model.flavor == "tiny_moe"
    for field in ("parallelism.tp", "generator.parallelism.tensor_parallel_degree"):
        assert parse_args([*qwen3_5, f"--{field}", "2"], world_size=2)
        with pytest.raises(ConfigError) as error:
            parse_args([*qwen3_5, f"--{field}", "4"], world_size=4)
        message = str(error.value)
        assert message.startswith(
            f"{field} = 4 does not divide the 2 key heads and 4 value heads of qwen3_5/tiny"
        )
        assert "\n" not in message


KIMI_TEXT = ("moonlight-16B-A3B", "tiny")


@pytest.mark.parametrize(
    ("name", "flavor", "text_only"),
    [
        ("kimi_k2_7", "debugmodel", KIMI_TEXT),
        ("kimi_k2_7", "Kimi-K2.5", KIMI_TEXT),
        ("kimi_k2_7", "Kimi-VL-A3B", KIMI_TEXT),
    ],
)
def test_a_flavor_with_a_vision_tower_is_refused_naming_the_text_only_ones(name, flavor, text_only):
    """Kimi K2.5's flavors build a vision tower (its debugmodel too), which the project does
    not run (Muse Glimmer's it does: test_vision.py); the others are text-only."""
    from torchtitan_rl.config import ConfigError

    flags = ["--job.config_file", DEBUG_TOML, "--model.name", name]
    with pytest.raises(ConfigError) as error:
        parse_args([*flags, "--model.flavor", flavor])
    assert str(error.value) == (
        f"model.flavor = {flavor!r} builds a vision tower (image and video inputs), which this "
        f"project does not run: use a text-only flavor ({', '.join(text_only)})"
    )
    for flavor in text_only:
        assert parse_args([*flags, "--model.flavor", flavor]).model.flavor == flavor


def test_mixture_of_experts_flavors_are_accepted():
    """qwen3's MoE flavors (torchtitan's and this project's tiny_moe) are valid flavors, and
    gpt-oss (all mixture-of-experts) is a valid family."""
    from torchtitan_rl.models import hf_architecture, is_mixture_of_experts

    for flavor in ("debugmodel_moe", "30B-A3B", "tiny_moe"):
        config = parse_args(["--job.config_file", DEBUG_TOML, "--model.flavor", flavor])
        assert config.model.flavor == flavor and is_mixture_of_experts("qwen3", flavor)
    assert not is_mixture_of_experts("qwen3", "tiny")
    assert hf_architecture("qwen3", "tiny_moe") == "Qwen3MoeForCausalLM"
    assert hf_architecture("qwen3", "tiny") == "Qwen3ForCausalLM"
    config = parse_args(
        ["--job.config_file", DEBUG_TOML, "--model.name", "gpt_oss", "--model.flavor", "tiny"]
    )
    assert config.model.name == "gpt_oss" and is_mixture_of_experts("gpt_oss", "tiny")
    assert hf_architecture("gpt_oss", "20b") == "GptOssForCausalLM"
    for name, flavor in (("deepseek_v3", "671B"), ("kimi_k2_7", "moonlight-16B-A3B")):
        config = parse_args(
            ["--job.config_file", DEBUG_TOML, "--model.name", name, "--model.flavor", flavor]
        )
        assert is_mixture_of_experts(name, flavor)
        assert hf_architecture(name, flavor) == "DeepseekV3ForCausalLM"


def test_enforce_eager_unset_compiles_where_the_generator_compiles(capsys):
    """generator.enforce_eager unset: compiled on one rank per engine and, tensor parallel, on
    local shards, dense and MoE alike; a vocabulary the ranks do not split evenly (68 tokens
    over 3) runs DTensors, eager, said in one console line, and false for it is refused in one
    line naming the fix, before any engine starts."""
    from torchtitan_rl.config import ConfigError, GeneratorParallelismSection, GeneratorSection
    from torchtitan_rl.generator.engine_build import compiles

    def generator(tp: int, eager):
        parallelism = GeneratorParallelismSection(tensor_parallel_degree=tp)
        return GeneratorSection(enforce_eager=eager, parallelism=parallelism)

    dense, moe = ModelSection(hf_checkpoint=TINY), ModelSection(flavor="tiny_moe")
    assert compiles(generator(1, None), dense) and compiles(generator(1, None), moe)
    assert compiles(generator(2, None), dense) and compiles(generator(2, False), dense)
    assert compiles(generator(2, None), moe) and compiles(generator(2, False), moe)
    assert not compiles(generator(1, True), dense) and not compiles(generator(2, True), moe)
    assert capsys.readouterr().err == ""
    assert not compiles(generator(3, None), moe)
    (line,) = capsys.readouterr().err.splitlines()
    assert "runs eager on DTensors" in line and "vocabulary of 68" in line
    assert "pick a tensor_parallel_degree that divides it" in line
    with pytest.raises(ConfigError) as error:
        compiles(generator(3, False), moe)
    message = str(error.value)
    assert "\n" not in message and "generator.enforce_eager = false" in message
    assert "unset enforce_eager or set it to true" in message


def test_training_compile_is_refused_in_batch_invariant_mode():
    """training.compile: accepted alone; with batch_invariant = true refused in one line that
    says why (inductor's kernels are not the generator's batch-invariant ones) and the fix."""
    from torchtitan_rl.config import ConfigError

    config = parse_args(["--job.config_file", DEBUG_TOML, "--training.compile"], world_size=2)
    assert config.training.compile is True
    with pytest.raises(ConfigError) as error:
        parse_args(
            ["--job.config_file", DEBUG_TOML, "--training.compile", "--batch_invariant", "true"],
            world_size=2,
        )
    message = str(error.value)
    assert "\n" not in message
    assert "batch_invariant = true with training.compile = true" in message
    assert "bit for bit" in message and "set training.compile = false" in message
