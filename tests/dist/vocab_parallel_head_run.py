"""The vocabulary-parallel head (trainer TP) against the whole head: each of 2 ranks holds its
rows of a 51-entry vocabulary (26 and 25: Shard(0)'s uneven split), the hidden states are the
same on both.

    torchrun --nproc_per_node 2 tests/dist/vocab_parallel_head_run.py OUT_DIR

Rank 0 saves both heads' logprobs, entropies and gradients (the weight's gathered from both
ranks' rows), and the widest block of logits either path built.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from torchtitan_rl import platform
from torchtitan_rl.trainer import logprobs

VOCAB, DIM, TOKENS, CHUNK, TEMPERATURE = 51, 16, 37, 8, 0.7


def main() -> None:
    out = Path(sys.argv[1])
    rank, world = platform.init_distributed()
    torch.manual_seed(0)  # the same tensors on both ranks
    hidden_ND = torch.randn(TOKENS, DIM)
    weight_VD = torch.randn(VOCAB, DIM)
    targets_N = torch.randint(0, VOCAB, (TOKENS,))
    coefficients_N = torch.randn(TOKENS)  # a loss that weighs every token differently

    widths = []
    linear = F.linear

    def recording(x, w, *rest):
        widths.append(w.shape[0])
        return linear(x, w, *rest)

    logprobs.F.linear = recording
    rows = -(-VOCAB // world)
    first = rank * rows
    result = {}
    for name, group, mine in (
        ("whole", None, slice(None)),
        ("parallel", dist.group.WORLD, slice(first, first + rows)),
    ):
        widths.clear()
        hidden = hidden_ND.clone().requires_grad_()
        weight = weight_VD[mine].clone().requires_grad_()
        logp_N, entropy_N = logprobs.head_logprobs(
            hidden, weight, targets_N, TEMPERATURE, chunk=CHUNK, group=group, first=first
        )
        (logp_N * coefficients_N).sum().backward()
        pieces = [torch.zeros(rows, DIM) for _ in range(world)] if group else None
        if group:
            padded = torch.zeros(rows, DIM)
            padded[: weight.grad.shape[0]] = weight.grad
            dist.all_gather(pieces, padded)
        result[name] = {
            "logprobs": logp_N.detach(),
            "entropy": entropy_N,
            "grad_hidden": hidden.grad,
            "grad_weight": torch.cat(pieces)[:VOCAB] if group else weight.grad,
            "widest_logits": max(widths),
        }
    if rank == 0:
        torch.save(result, out / "head.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
