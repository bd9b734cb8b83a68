"""On-policy distillation's pieces: the [distill] section and learn_from, bad teachers refused in
one line, the loss with per-token advantages and the teacher's KL term, and the learner's
teacher signal per source.

    .venv/bin/python -m pytest tests/unit/test_distill.py

Whole runs (a teacher sharded over 2 ranks against HF transformers, an identical student, a
mixture, a LoRA student, resume): tests/integration/test_mixture.py, test_lora.py,
test_resume.py.
"""

import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from helpers.launch import REPO

from torchtitan_rl import learner as learner_module
from torchtitan_rl.algorithms.losses import PolicyLoss, kl_penalty
from torchtitan_rl.config import ConfigError, parse_args
from torchtitan_rl.learner import Learner
from torchtitan_rl.trainer.model import build_spec, check_hf_checkpoint, hf_shapes
from torchtitan_rl.types import LossScale, Prompt, RolloutBatch

DEBUG = ("--job.config_file", "run_configs/debug_cpu.toml")
TEACHER = ("--distill.teacher_checkpoint", "assets/tiny_qwen3")
MIXTURE = ("--job.config_file", "run_configs/mixture_cpu.toml")
MIXTURE += ("--model.hf_checkpoint", "assets/tiny_qwen3")


def parse(*flags: str, world: int = 2):
    return parse_args(list(flags), world)


def test_learn_from_defaults_to_the_teacher_when_there_is_one_and_is_set_per_source():
    assert parse(*DEBUG).task.learn_from == "reward"
    assert parse(*DEBUG, *TEACHER).task.learn_from == "teacher"
    config = parse(*MIXTURE, *TEACHER, "--task.sources.tools.learn_from", "reward")
    assert {n: s.learn_from for n, s in config.task.sources.items()} == {
        "minmax": "teacher",
        "tools": "reward",
    }
    assert config.task.learn_from is None  # a mixture's own fields stay unset


@pytest.mark.parametrize(
    "flags, message",
    [
        (("--distill.coef", "2"), "distill.coef = 2.0 does nothing without a teacher"),
        (("--task.learn_from", "teacher"), "task.learn_from = 'teacher' needs a teacher"),
        (
            ("--distill.teacher_checkpoint", "/no/such"),
            "distill.teacher_checkpoint = '/no/such': no such directory",
        ),
        ((*TEACHER, "--distill.coef", "0"), "distill.coef = 0.0: must be > 0"),
        (
            (*TEACHER, "--task.learn_from", "reward"),
            "every source has learn_from = 'reward'",
        ),
        (
            (*TEACHER, "--distill.teacher_flavor", "huge"),
            "distill.teacher_flavor = 'huge' is not a qwen3 flavor",
        ),
        (
            ("--distill.teacher_checkpoint", "{other_vocab}"),
            "has a vocabulary of 2048 tokens, the student (qwen3/tiny) 68",
        ),
        (
            (*TEACHER, "--distill.teacher_flavor", "debugmodel"),
            "distill.teacher_flavor = 'debugmodel' has a vocabulary of 2048 tokens",
        ),
        (
            (*TEACHER, "--algorithm.loss", "dapo"),
            "task.learn_from = 'teacher' with algorithm.dynamic_sampling",
        ),
    ],
)
def test_bad_distill_settings_are_refused_in_one_line(flags, message, tmp_path):
    # A teacher of another vocabulary: the tiny checkpoint's folder, its config.json saying so.
    other = tmp_path / "other_vocab"
    shutil.copytree(REPO / "assets" / "tiny_qwen3", other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "vocab_size": 2048}))
    with pytest.raises(ConfigError) as error:
        parse(*DEBUG, *(f.format(other_vocab=other) for f in flags))
    assert message in str(error.value) and "\n" not in str(error.value)


def test_an_sft_run_refuses_a_teacher():
    with pytest.raises(ConfigError, match="distill.teacher_checkpoint = .* an SFT run"):
        parse_args(
            ["--job.config_file", "run_configs/sft_arith_cpu.toml", *TEACHER], 2, entry="sft"
        )


def test_a_teacher_with_another_tokenizer_is_refused(tmp_path):
    teacher = tmp_path / "teacher"
    shutil.copytree("assets/tiny_qwen3", teacher)
    text = (teacher / "tokenizer.json").read_text()
    # Two tokens trade ids: the same vocabulary size, another tokenizer.
    (teacher / "tokenizer.json").write_text(
        text.replace('"0": ', '"@@": ').replace('"1": ', '"0": ').replace('"@@": ', '"1": ')
    )
    with pytest.raises(ConfigError, match="maps tokens to ids unlike the student's"):
        parse(*DEBUG, "--distill.teacher_checkpoint", str(teacher))
    (teacher / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match="has no tokenizer.json"):
        parse(*DEBUG, "--distill.teacher_checkpoint", str(teacher))


def test_a_teacher_checkpoint_that_does_not_load_names_the_distill_fields():
    """A Llama checkpoint passes the config's checks (same tokenizer and vocabulary) but not
    the qwen3 teacher's tensors: the error names distill.*, not model.*."""
    config = parse(*DEBUG, "--distill.teacher_checkpoint", "assets/tiny_llama3")
    spec = build_spec(config.model)
    fields = ("distill.teacher_checkpoint", "distill.teacher_flavor")
    with pytest.raises(ConfigError) as error:
        check_hf_checkpoint("assets/tiny_llama3", hf_shapes(spec), "tiny", fields)
    assert str(error.value).startswith("distill.teacher_checkpoint = 'assets/tiny_llama3'")
    assert "distill.teacher_flavor = 'tiny'" in str(error.value)


# A batch of two sequences of three tokens, the first token the prompt.
MASK_BT = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]])


def two_rows(**fields) -> RolloutBatch:
    return RolloutBatch(
        tokens_BT=torch.zeros(2, 3, dtype=torch.long),
        loss_mask_BT=MASK_BT,
        advantages_B=torch.tensor([1.0, 0.0]),
        generator_logprobs_BT=torch.full((2, 3), -1.0) * MASK_BT,
        **fields,
    )


def loss(batch: RolloutBatch, **kwargs) -> tuple[torch.Tensor, torch.Tensor, dict]:
    policy = PolicyLoss(
        clip_low=0.2, clip_high=0.2, aggregation="token_mean", max_tokens=2, **kwargs
    )
    logprobs_BT = torch.full((2, 3), -1.0, requires_grad=True)
    value, metrics = policy(logprobs_BT, batch, LossScale(tokens=3, sequences=2))
    value.backward()
    return value, logprobs_BT.grad, metrics


def test_token_advantages_add_to_the_sequence_s_in_the_loss():
    tokens_BT = torch.tensor([[0.0, 0.5, -2.0], [0.0, 3.0, 0.0]])
    value, grad, _ = loss(two_rows(token_advantages_BT=tokens_BT))
    # On policy (ratio 1) each sampled token's loss is -A_t, its gradient -A_t / tokens.
    advantages_BT = torch.tensor([[1.0, 1.5, -1.0], [0.0, 3.0, 0.0]]) * MASK_BT
    assert value.item() == pytest.approx(-advantages_BT.sum().item() / 3)
    torch.testing.assert_close(grad, -advantages_BT / 3)


def test_the_teacher_s_kl_term_acts_on_distilled_rows_only():
    teacher_BT = torch.full((2, 3), -3.0)
    batch = two_rows(teacher_logprobs_BT=teacher_BT, distilled_B=torch.tensor([1.0, 0.0]))
    value, grad, metrics = loss(batch, teacher_coef=0.5)
    plain, plain_grad, _ = loss(two_rows())
    kl = kl_penalty(torch.tensor(-1.0), torch.tensor(-3.0), "k3").item()  # e^-2 - 1 + 2
    assert value.item() == pytest.approx(plain.item() + 0.5 * 2 * kl / 3)
    assert metrics["teacher_kl_sum"] == pytest.approx(2 * kl)
    # The second row is not distilled: its gradient is the plain loss's.
    torch.testing.assert_close(grad[1], plain_grad[1])
    assert not torch.equal(grad[0], plain_grad[0])
    assert "distill/kl" in PolicyLoss.TOKEN_METRICS


class Teacher:
    """Stands in for the sharded teacher (a PolicyTrainer): fixed logprobs, and what it was
    asked to score."""

    def __init__(self, logprobs_BT: torch.Tensor):
        self.logprobs_BT, self.masks = logprobs_BT, []

    def logprobs(self, tokens_BT, mask_BT, images_B=None):
        self.masks.append(mask_BT)
        return self.logprobs_BT, None


def learner(config, teacher: Teacher) -> Learner:
    """A Learner with only what `distill` reads (no model, no engine)."""
    learner = Learner.__new__(Learner)
    learner.config, learner.teacher, learner.group = config, teacher, None
    return learner


@pytest.fixture
def one_rank(monkeypatch):
    """The figures' all-reduce over a world of one rank: the values as they are."""
    monkeypatch.setattr(learner_module.platform, "all_reduce_host", lambda values, **_: values)


def rollouts(sources: list[str], n: int = 1):
    return SimpleNamespace(prompts=[Prompt(text="", answer="", source=s) for s in sources])


def test_each_source_learns_from_what_it_names(one_rank):
    """A mixture: minmax learns from the teacher alone, tools from the reward alone; then one
    source learning from both logs the two advantages' sizes."""
    config = parse(*MIXTURE, *TEACHER, "--task.sources.tools.learn_from", "reward")
    batch = two_rows()
    batch.generator_logprobs_BT = torch.tensor([[0.0, -1.0, -2.0], [0.0, -1.0, 0.0]])
    teacher = Teacher(torch.tensor([[-9.0, -1.5, -1.0], [-9.0, -4.0, -9.0]]))
    advantages_PN = torch.tensor([[0.5], [-0.5]])
    metrics = learner(config, teacher).distill(
        1, batch, rollouts(["minmax", "tools"]), advantages_PN
    )
    # The teacher scores only the distilled rows' sampled tokens.
    torch.testing.assert_close(teacher.masks[0], torch.tensor([[0.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    # minmax: the reward's advantage zeroed, each token's -(generator - teacher).
    assert advantages_PN.tolist() == [[0.0], [-0.5]]
    torch.testing.assert_close(
        batch.token_advantages_BT, torch.tensor([[0.0, -0.5, 1.0], [0.0, 0.0, 0.0]])
    )
    assert batch.distilled_B.tolist() == [1.0, 0.0]
    assert metrics == {
        "distill/reverse_kl": pytest.approx((0.5 - 1.0) / 2),
        "distill/teacher_logprob": pytest.approx((-1.5 - 1.0) / 2),
        "distill/reverse_kl/minmax": pytest.approx(-0.25),
    }

    config.task.sources["minmax"].learn_from = "both"
    advantages_PN = torch.tensor([[0.5], [-0.5]])
    metrics = learner(config, teacher).distill(
        1, two_rows(), rollouts(["minmax", "tools"]), advantages_PN
    )
    assert advantages_PN.tolist() == [[0.5], [-0.5]]  # nothing zeroed
    # |reward advantage| and |teacher advantage| per sampled token (3 of them).
    assert metrics["distill/advantage_reward"] == pytest.approx((0.5 * 2 + 0.5) / 3)
    assert metrics["distill/advantage_teacher"] == pytest.approx((0.5 + 0.0) / 3)


def test_a_teacher_equal_to_the_student_gives_zero_kl_and_zero_advantages(one_rank):
    config = parse(*DEBUG, *TEACHER)
    batch = two_rows()
    advantages_PN = torch.tensor([[1.0, -1.0]])
    metrics = learner(config, Teacher(batch.generator_logprobs_BT.clone())).distill(
        1, batch, rollouts([""]), advantages_PN
    )
    assert metrics["distill/reverse_kl"] == 0.0
    assert advantages_PN.abs().max() == 0 and batch.token_advantages_BT.abs().max() == 0


@pytest.mark.parametrize("field", ["reference_logprobs_BT", "teacher_logprobs_BT"])
def test_a_kl_term_scored_at_sampled_tokens_only_stays_finite_elsewhere(field):
    """The reference and the teacher are scored only at sampled tokens (0 elsewhere): a prompt
    token the policy finds very unlikely (logprob -200, exp(200) overflows) must not turn the
    loss or its gradient into NaN (inf * a loss mask of 0)."""
    scored_BT = torch.full((2, 3), -2.0) * MASK_BT
    batch = two_rows(**{field: scored_BT}, distilled_B=torch.ones(2))
    coefs = {"kl_beta": 0.1} if field == "reference_logprobs_BT" else {"teacher_coef": 0.1}
    policy = PolicyLoss(
        clip_low=0.2, clip_high=0.2, aggregation="token_mean", max_tokens=2, **coefs
    )
    logprobs_BT = torch.tensor([[-200.0, -1.0, -1.0], [-200.0, -1.0, -300.0]], requires_grad=True)
    value, _ = policy(logprobs_BT, batch, LossScale(tokens=3, sequences=2))
    value.backward()
    kl = kl_penalty(torch.tensor(-1.0), torch.tensor(-2.0), "k3").item()
    assert value.item() == pytest.approx((-1.0 * 2 + 0.1 * kl * 3) / 3)
    assert torch.isfinite(logprobs_BT.grad).all() and logprobs_BT.grad[:, 0].eq(0).all()
