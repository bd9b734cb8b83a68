"""The fixed RolloutBatch and policy-gradient loss that the PolicyTrainer worlds
(tests/dist/policy_trainer_run.py, lora_run.py) train on, and their tests replay; and a way
to read the gradients a step applies."""

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from torchtitan_rl.types import LossScale, RolloutBatch


def fixed_batch() -> RolloutBatch:
    """8 right-padded sequences: a prompt of 4 tokens, completions of different lengths."""
    g = torch.Generator().manual_seed(0)
    B, T = 8, 12
    tokens_BT = torch.randint(3, 64, (B, T), generator=g)
    loss_mask_BT = torch.zeros(B, T)
    for b in range(B):
        end = 6 + b % 6
        loss_mask_BT[b, 4:end] = 1.0
        tokens_BT[b, end:] = 0  # padding
    return RolloutBatch(
        tokens_BT=tokens_BT,
        loss_mask_BT=loss_mask_BT,
        advantages_B=torch.linspace(-1.0, 1.0, B),
        generator_logprobs_BT=torch.zeros(B, T),
    )


def pg_loss(logprobs_BT, batch: RolloutBatch, scale: LossScale):
    """Token-mean policy gradient: -sum(A * logprob * mask) / global tokens."""
    weighted_BT = batch.advantages_B[:, None] * logprobs_BT * batch.loss_mask_BT
    return -weighted_BT.sum() / scale.tokens, {"masked_tokens": float(batch.loss_mask_BT.sum())}


@contextmanager
def recorded_grads(trainer) -> Iterator[dict[str, torch.Tensor]]:
    """Within the block, each optimizer step of `trainer` (a PolicyTrainer) first records the
    summed gradients it is about to apply, as full tensors (a collective under FSDP/TP), into
    the dict yielded."""
    grads, step = {}, trainer.optimizers.step

    def record_then_step(*args, **kwargs):
        for name, param in trainer.named_parameters().items():
            grad = param.grad
            grads[name] = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).clone()
        return step(*args, **kwargs)

    trainer.optimizers.step = record_then_step
    try:
        yield grads
    finally:
        trainer.optimizers.step = step
