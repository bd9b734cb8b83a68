"""The flags of the runs several integration tests share (tests/integration/conftest.py starts
each once per session) and of the runs that repeat them (killed and resumed, other layouts)."""

from pathlib import Path

from helpers.launch import DEBUG_TOML, REPO

# The echo demo on 2 ranks: 6 steps at a learning rate that moves the policy, a KL penalty
# (so a reference model and a "kl" figure), checkpoints at steps 3 and 6, an HF export, every
# step's rollouts logged, TensorBoard. The session's reference run adds W&B (offline).
REFERENCE = (
    *("--job.config_file", DEBUG_TOML, "--training.steps", "6", "--training.lr", "1e-2"),
    *("--algorithm.kl_beta", "0.05"),
    *("--checkpoint.enable", "true", "--checkpoint.interval", "3"),
    *("--checkpoint.export_hf_at_end", "true"),
    *("--metrics.enable_tensorboard", "true", "--metrics.rollout_log_interval", "1"),
)
WANDB = ("--metrics.enable_wandb", "true")
# Multi-turn episodes a random model plays (user_envs.Chatter, or user_envs.chatter_agent through
# the gateway): 3 turns on the arithmetic rows, each ended by a digit or 6 tokens.
CHATTER = (
    *("--task.dataset_path", "data/arith/train.jsonl", "--task.max_turns", "3"),
    *("--generator.sampling.max_tokens", "6", "--generator.sampling.stop", *"0123456789"),
)
# The real wandb package, writing locally: nothing here can reach W&B's servers.
WANDB_ENV = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
# What the reference run's generator, holding the final weights, completes greedily.
GREEDY_PROMPT, GREEDY_TOKENS = "echo 123:", 8

# The reference run's schedule on the mixture-of-experts tiny Qwen3 (8 experts, 2 per token),
# experts split over the 2 ranks (EP = 2) in the trainer and in one generator spanning both,
# every weight sync verified by digest.
MOE_MODEL = (
    *("--model.flavor", "tiny_moe", "--model.hf_checkpoint", "assets/tiny_moe_qwen3"),
    *("--parallelism.ep", "2"),
)
GPT_OSS_MODEL = (
    *("--model.name", "gpt_oss", "--model.flavor", "tiny"),
    *("--model.hf_checkpoint", "assets/tiny_gpt_oss", "--parallelism.ep", "2"),
)
MUSE_GLIMMER_MODEL = (
    *("--model.name", "muse_glimmer", "--model.flavor", "tiny"),
    *("--model.hf_checkpoint", "assets/tiny_muse_glimmer"),
)
# Muse Glimmer with its vision tower (trained: freeze_vision false), on a small copy of the
# vision demo's data (`vision_task`): prompts of a question and an image of 1 to 9 tokens.
VISION_MODEL = (
    *("--model.name", "muse_glimmer", "--model.flavor", "tiny_vl"),
    *("--model.hf_checkpoint", "assets/tiny_vl_muse_glimmer", "--model.freeze_vision", "false"),
)


def vision_task(
    folder: Path, train_rows: int = 64, eval_rows: int = 16, env: str | None = None
) -> tuple[str, ...]:
    """The vision demo's task (scripts/make_visual_data.py) on `train_rows` rows written to
    `folder`: its flags. Rewarded by the answer's letters a completion holds, not the demo's
    exact match, which a random model never scores: every step trains. `env`: its rows
    played by that environment (task.env), which rewards them."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "visual", REPO / "scripts" / "make_visual_data.py"
    )
    visual = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(visual)
    visual.write(folder, seed=0, train_rows=train_rows, eval_rows=eval_rows, sft_rows=train_rows)
    played = (
        "--task.name",
        "dataset",
        "--task.reward_fn",
        "helpers.user_rewards:letters_of_answer",
    )
    if env is not None:
        played = ("--task.name", "env", "--task.env", env)
    return (
        *("--task.messages_key", "messages"),
        *("--task.dataset_path", str(folder / "train.jsonl")),
        *played,
        *("--generator.sampling.max_tokens", "8"),
    )


# Qwen3.5: three Gated DeltaNet layers and a gated full-attention one; its MoE with a
# sigmoid-gated shared expert, the experts over the 2 ranks (EP = 2).
QWEN3_5_MODEL = (
    *("--model.name", "qwen3_5", "--model.flavor", "tiny"),
    *("--model.hf_checkpoint", "assets/tiny_qwen3_5"),
)
QWEN3_5_MOE_MODEL = (
    *("--model.name", "qwen3_5", "--model.flavor", "tiny_moe"),
    *("--model.hf_checkpoint", "assets/tiny_moe_qwen3_5", "--parallelism.ep", "2"),
)
# DeepSeek-V3 with group-limited routing, and Kimi K2's text tower: latent attention, shared
# experts, sigmoid routing with the correction bias; the experts over the 2 ranks (EP = 2).
DEEPSEEK_V3_MODEL = (
    *("--model.name", "deepseek_v3", "--model.flavor", "tiny_grouped"),
    *("--model.hf_checkpoint", "assets/tiny_grouped_deepseek_v3", "--parallelism.ep", "2"),
)
KIMI_MODEL = (
    *("--model.name", "kimi_k2_7", "--model.flavor", "tiny"),
    *("--model.hf_checkpoint", "assets/tiny_kimi_k2_7", "--parallelism.ep", "2"),
)
MOE = (
    *("--job.config_file", DEBUG_TOML, "--training.steps", "6", "--training.lr", "1e-2"),
    *MOE_MODEL,
    # One generator over both ranks, its experts split between them (generator EP = 2).
    *("--generator.parallelism.tensor_parallel_degree", "2"),
    *("--generator.parallelism.expert_parallel", "true"),
    *("--generator.verify_weight_sync", "true"),
    *("--algorithm.kl_beta", "0.05"),
    *("--checkpoint.enable", "true", "--checkpoint.interval", "3"),
    *("--checkpoint.export_hf_at_end", "true"),
)

# The echo demo with LoRA, batch-invariant, checkpoints at steps 3 and 6, merged export; a
# distill teacher, the starting checkpoint itself, whose per-token signal adds to the reward's
# (so the student starts equal to its teacher: reverse KL exactly 0 at step 1).
LORA = (
    *("--job.config_file", DEBUG_TOML, "--training.steps", "6", "--training.lr", "1e-2"),
    *("--lora.enable", "true", "--batch_invariant", "true"),
    *("--distill.teacher_checkpoint", "assets/tiny_qwen3", "--task.learn_from", "both"),
    *("--checkpoint.enable", "true", "--checkpoint.interval", "3"),
    *("--checkpoint.export_hf_at_end", "true"),
)


def assert_distilled_from_an_equal_start(rows: list[dict]) -> None:
    """LORA's teacher is the starting checkpoint: at step 1 the student (adapters at 0)
    equals it bit for bit, so the reverse KL and the teacher's advantages are exactly 0 while
    the reward's are not; the student then leaves it. The figures are those of the teacher's
    own forward (sharded, batch-invariant), not the student's."""
    first = rows[0]
    assert first["distill/reverse_kl"] == 0.0 and first["distill/advantage_teacher"] == 0.0
    assert first["distill/advantage_reward"] > 0
    assert first["distill/teacher_logprob"] < 0
    assert all(row["distill/reverse_kl"] != 0.0 for row in rows[1:])
    assert all(row["distill/advantage_teacher"] > 0 for row in rows[1:])


# SFT on the arithmetic demonstrations: 30 steps of 16 rows in micro-batches of 2 rows;
# checkpoints and evaluations at 10, 20 and 30.
SFT = (
    *("--job.config_file", "run_configs/sft_arith_cpu.toml"),
    *("--training.steps", "30", "--sft.micro_batch_tokens", "64"),
    *("--checkpoint.enable", "true", "--checkpoint.interval", "10"),
    *("--eval.interval", "10", "--eval.log_samples", "36"),
)
