"""training.compile: torchtitan's per-block torch.compile of the policy, in a one-process world.

.venv/bin/python -m pytest tests/integration/test_compile.py

Compiled and eager trainers of the tiny checkpoint train alike (logprobs, loss, gradients within
fp32 tolerance), and new packings of the rows do not recompile the blocks: the packed attention
is one opaque op in their graphs (trainer/compile.py). In the integration tier though it runs
in the pytest process: inductor takes seconds, and it probes the CPU's vector ISA by loading a
test library in a child Python, which the unit tier refuses.
"""

import pytest
import torch
import torch._inductor.config
from helpers.launch import REPO
from torch._dynamo.utils import counters

from torchtitan_rl import platform
from torchtitan_rl.config import (
    ConfigError,
    ModelSection,
    ParallelismSection,
    TrainingSection,
    parse_args,
)
from torchtitan_rl.trainer.compile import compilable_attention
from torchtitan_rl.trainer.model import build_spec
from torchtitan_rl.trainer.policy_trainer import PolicyTrainer, StepResult
from torchtitan_rl.types import RolloutBatch

TINY = REPO / "assets" / "tiny_qwen3"


@pytest.fixture(scope="module", autouse=True)
def _world_of_one():
    platform.patch_torchtitan()
    platform.init_distributed()


@pytest.fixture(autouse=True)
def _compile_in_this_process():
    # Inductor's pool of compile workers would outlive the test (tests/conftest.py kills it).
    with torch._inductor.config.patch(compile_threads=1):
        yield


def trainer(compile: bool) -> PolicyTrainer:
    return PolicyTrainer(
        model=ModelSection(hf_checkpoint=str(TINY)),
        training=TrainingSection(lr=1e-3, compile=compile),
        parallelism=ParallelismSection(),
    )


def batch(lengths: list[int], seed: int) -> RolloutBatch:
    """Rows of `lengths` tokens (4 prompt tokens, the rest trained), right-padded."""
    generator = torch.Generator().manual_seed(seed)
    tokens_BT = torch.randint(3, 64, (len(lengths), max(lengths)), generator=generator)
    mask_BT = torch.zeros(tokens_BT.shape)
    for row, length in enumerate(lengths):
        mask_BT[row, 4:length] = 1.0
    return RolloutBatch(
        tokens_BT=tokens_BT,
        loss_mask_BT=mask_BT,
        advantages_B=torch.randn(len(lengths), generator=generator),
        generator_logprobs_BT=torch.zeros(tokens_BT.shape),
    )


def pg_loss(logprobs_BT, micro, scale):
    weighted = micro.advantages_B[:, None] * logprobs_BT * micro.loss_mask_BT
    return -weighted.sum() / scale.tokens, {}


def step(t: PolicyTrainer, rows: RolloutBatch) -> tuple[StepResult, dict[str, torch.Tensor]]:
    """One optimizer step, and the gradients it applied (read before the optimizer steps)."""
    grads = {}

    def record(*_):
        for name, param in t.model.named_parameters():
            grads[name] = getattr(param.grad, "full_tensor", param.grad.detach)().clone()

    hook = t.optimizers.register_step_pre_hook(record)
    try:
        return t.optimizer_step(rows, pg_loss), grads
    finally:
        hook.remove()


def graphs() -> int:
    """Graphs Dynamo has compiled in this process."""
    return counters["stats"]["unique_graphs"]


def test_compiled_blocks_train_as_eager_and_new_packings_do_not_recompile():
    counters.clear()
    eager, compiled = trainer(False), trainer(True)
    first = batch([10, 7, 12], seed=0)
    # The frozen reference's and teacher's call: no gradient.
    scored = eager.logprobs(first.tokens_BT, first.loss_mask_BT)[0]
    assert graphs() == 0  # the eager trainer compiled nothing
    torch.testing.assert_close(compiled.logprobs(first.tokens_BT, first.loss_mask_BT)[0], scored)
    assert graphs() >= 1, "training.compile = true compiled no graph"

    eager_step, eager_grads = step(eager, first)
    compiled_step, compiled_grads = step(compiled, first)
    torch.testing.assert_close(compiled_step.logprobs_BT, eager_step.logprobs_BT)
    assert compiled_step.metrics["loss"] == pytest.approx(eager_step.metrics["loss"], rel=1e-5)
    assert compiled_grads.keys() == eager_grads.keys() and len(eager_grads) > 0
    for name, grad in eager_grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)

    # Other packings: more documents, other lengths, other row lengths. The row length turns
    # dynamic at the first change (one more graph); after that nothing recompiles.
    after_first = graphs()
    step(compiled, batch([9, 14, 5, 6], seed=1))
    after_second = graphs()
    assert after_second - after_first <= 1
    for seed, lengths in enumerate(([11, 11, 3], [8, 8, 8, 8, 13]), start=2):
        result, _ = step(compiled, batch(lengths, seed))
        assert graphs() == after_second, f"rows of {lengths} recompiled"
        assert torch.isfinite(result.logprobs_BT).all()


def test_sliding_window_models_are_refused_in_one_line():
    """gpt-oss's and Muse Glimmer's window layers run per document from host offsets: refused
    at config validation naming the model (and at build, before any compile), instead of
    recompiling at every packing."""
    model = ModelSection(name="gpt_oss", hf_checkpoint=str(REPO / "assets" / "tiny_gpt_oss"))
    with torch.device("meta"):
        module = build_spec(model).model.build()
    with pytest.raises(ConfigError) as error:
        compilable_attention(module)
    message = str(error.value)
    assert "\n" not in message and "set training.compile = false" in message
    for name, flavor, windowed in (("gpt_oss", "tiny", "1"), ("muse_glimmer", "tiny_vl", "3")):
        args = ["--model.name", name, "--model.flavor", flavor, "--training.compile", "true"]
        with pytest.raises(ConfigError) as error:
            parse_args(["--job.config_file", str(REPO / "run_configs" / "debug_cpu.toml"), *args])
        assert str(error.value).startswith(
            f"training.compile = true: {name}/{flavor}'s {windowed} sliding-window attention "
            "layers (of"
        ), str(error.value)
    qwen3 = ModelSection(hf_checkpoint=str(TINY))
    with torch.device("meta"):
        assert compilable_attention(build_spec(qwen3).model.build()) == 2  # its 2 layers
