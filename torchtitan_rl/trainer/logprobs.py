"""Per-token log-probabilities and entropy from logits, chunked over the sequence.

    .venv/bin/python -m pytest tests/unit/test_logprobs.py

Shapes: B batch, T sequence, V vocabulary, C a chunk of T.
Alignment: `logprobs_BT[:, t]` is log p(tokens[:, t] | tokens[:, :t]), read from the logits at
position t - 1 (the logits at t score token t + 1). Column 0 has no prediction and is 0.
"""

import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

# At most this many fp32 elements (B * C * V) are upcast at once: 256 MiB.
CHUNK_ELEMENTS = 2**26


def _log_softmax(logits_BCV: torch.Tensor, temperature: float) -> torch.Tensor:
    scaled_BCV = logits_BCV.float()
    if temperature != 1.0:
        scaled_BCV = scaled_BCV / temperature
    # log_softmax, then pick: the very ops vLLM reports processed logprobs with, so equal logits
    # give bitwise-equal logprobs (picked - logsumexp rounds differently).
    return torch.log_softmax(scaled_BCV, dim=-1)


def _chunk_logprobs(logits_BCV: torch.Tensor, targets_BC: torch.Tensor, temperature: float):
    logp_BCV = _log_softmax(logits_BCV, temperature)
    return logp_BCV.gather(-1, targets_BC.unsqueeze(-1)).squeeze(-1)


def _entropy(logp_BCV: torch.Tensor) -> torch.Tensor:
    # In place on the exp: one [.., V] temporary, not two (at V = 151,936 each is C * 0.6 MB).
    return -logp_BCV.exp().mul_(logp_BCV).sum(-1)


@torch.no_grad()
def _chunk_entropy(logits_BCV: torch.Tensor, temperature: float) -> torch.Tensor:
    return _entropy(_log_softmax(logits_BCV, temperature))


def token_logprobs(
    logits_BTV: torch.Tensor,
    tokens_BT: torch.Tensor,
    temperature: float = 1.0,
    *,
    with_entropy: bool = False,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities of `tokens_BT` under `logits_BTV / temperature`, fp32, [B, T].

    Works chunk by chunk over T so that at most one fp32 [B, C, V] copy exists at a time; under
    autograd each chunk is recomputed in backward instead of saving its fp32 copy, so the only
    [B, T, V] tensor kept is `logits_BTV` itself. With `with_entropy`, also returns the entropy
    of each position's predictive distribution (no gradient), aligned like the logprobs.
    """
    B, T, V = logits_BTV.shape
    chunk = max(1, chunk_elements // max(1, B * V))
    logits_BTV, targets_BT = logits_BTV[:, :-1], tokens_BT[:, 1:]
    pieces, entropies = [], []
    for start in range(0, T - 1, chunk):
        logits_BCV = logits_BTV[:, start : start + chunk]
        targets_BC = targets_BT[:, start : start + chunk]
        if torch.is_grad_enabled() and logits_BCV.requires_grad:
            piece = checkpoint(
                _chunk_logprobs, logits_BCV, targets_BC, temperature, use_reentrant=False
            )
        else:
            piece = _chunk_logprobs(logits_BCV, targets_BC, temperature)
        pieces.append(piece)
        if with_entropy:
            entropies.append(_chunk_entropy(logits_BCV, temperature))
    logprobs_BT = F.pad(torch.cat(pieces, dim=1), (1, 0))
    entropy_BT = F.pad(torch.cat(entropies, dim=1), (1, 0)) if with_entropy else None
    return logprobs_BT, entropy_BT


# The fused head's chunk: at most HEAD_CHUNK tokens, and at most a memory budget of fp32
# logits [C, V] (training.head_chunk_mib, or `platform.head_chunk_mib()`), recomputed in
# backward instead of saved. A chunk holds about three [C, V] blocks at once (logits,
# log_softmax, the entropy's exp): at Qwen3's 151,936-entry vocabulary the CPU default of
# 256 MiB is 441 tokens, 0.75 GiB; CUDA's 1 GiB is 1,766 tokens, whose GEMMs keep the tensor
# cores busy (docs/performance.md).
HEAD_CHUNK = 4096
MIB = 2**20


@dataclass(frozen=True, slots=True)
class SoftCap:
    """An output head's elementwise transform of its logits z, in fp32: `cap * tanh(z *
    multiplier / cap)`, or `z * multiplier` without a cap (Muse Glimmer's head, torchtitan's
    `SoftCappedLinear`, in the order of its ops). The trainer's fused head and the generator's
    head both run `__call__`, so equal logits give equal capped bits on both sides."""

    multiplier: float = 1.0
    cap: float | None = None

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        if self.cap is None:
            return logits * self.multiplier
        return self.cap * torch.tanh(logits * self.multiplier / self.cap)

    def with_slope(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`self(logits)` (the same ops, so the same bits) and d capped / d logits, elementwise,
        at `logits` (fp32 results), from one tanh."""
        logits = logits.float()
        if self.cap is None:
            return logits * self.multiplier, torch.full_like(logits, self.multiplier)
        tanh = torch.tanh(logits * self.multiplier / self.cap)
        capped = self.cap * tanh
        return capped, tanh.square_().neg_().add_(1.0).mul_(self.multiplier)


def soft_cap(head: torch.nn.Module) -> SoftCap | None:
    """The transform that output projection `head` applies to its logits (None: plain): read
    from torchtitan's `SoftCappedLinear` attributes, so a module without them has none."""
    if not hasattr(head, "output_multiplier"):
        return None
    return SoftCap(float(head.output_multiplier), head.output_soft_cap_temp)


def _capped(logits: torch.Tensor, cap: SoftCap | None) -> torch.Tensor:
    return logits if cap is None else cap(logits)


def head_chunk(vocab: int, budget_mib: int | None = None) -> int:
    """Tokens per chunk of `head_logprobs` for a `vocab`-entry output projection whose fp32
    logits may take `budget_mib` MiB per chunk (None: CHUNK_ELEMENTS of them)."""
    budget = CHUNK_ELEMENTS * 4 if budget_mib is None else budget_mib * MIB
    return max(1, min(HEAD_CHUNK, budget // (4 * vocab)))


def _head_logits(hidden_CD: torch.Tensor, weight_VD: torch.Tensor) -> torch.Tensor:
    # The mode is on only where batch_invariant.enable() ran, so only where it was imported;
    # not importing it here keeps this module torch-only (scripts/gpu_check.py runs it on a GPU
    # machine without torchtitan, which batch_invariant imports).
    batch_invariant = sys.modules.get("torchtitan_rl.batch_invariant")
    if batch_invariant is not None and batch_invariant.uses_own_kernels():
        # The generator's head runs ops.linear: the same kernel gives the same bits.
        return batch_invariant.ops.linear(hidden_CD, weight_VD)
    return F.linear(hidden_CD, weight_VD)


def _project_back(
    grad_CV: torch.Tensor,
    hidden_CD: torch.Tensor,
    weight_VD: torch.Tensor,
    grad_weight_VD: torch.Tensor,
) -> torch.Tensor:
    """One chunk's backward GEMMs in the compute dtype (bf16 where the model computes in bf16:
    tensor cores), from fp32 d logprob / d logits `grad_CV`: returns d hidden [C, D] and adds
    d weight into the fp32 `grad_weight_VD` (each chunk's product is rounded once, the sum
    over chunks is fp32)."""
    grad_CV = grad_CV.to(weight_VD.dtype)
    grad_weight_VD.add_(grad_CV.t() @ hidden_CD)
    return grad_CV @ weight_VD


class _HeadLogprobs(torch.autograd.Function):
    """logprob of `targets_N` under log_softmax(hidden_ND @ weight_VD.T / T), chunk by chunk.
    No [N, V] tensor outlives one chunk: backward recomputes each chunk's logits with the
    forward's own GEMM (the same bits), except the last chunk's, which the forward keeps (it
    is the one [chunk, V] block alive anyway, and backward starts from it and frees it first).
    GEMMs run in the dtype of `hidden_ND` and `weight_VD`; softmax, logsumexp, the picked
    logprob, the entropy and the weight gradient's sum are fp32."""

    @staticmethod
    def forward(ctx, hidden_ND, weight_VD, targets_N, temperature, chunk, cap):
        logprobs, entropies = [], []
        logp_CV = None
        for start in range(0, hidden_ND.shape[0], chunk):
            del logp_CV
            # One log_softmax per chunk serves both the logprob and the entropy.
            logits_CV = _head_logits(hidden_ND[start : start + chunk], weight_VD)
            logp_CV = _log_softmax(_capped(logits_CV, cap), temperature)
            del logits_CV
            logprobs.append(logp_CV.gather(-1, targets_N[start : start + chunk, None]).squeeze(-1))
            entropies.append(_entropy(logp_CV))
        ctx.save_for_backward(hidden_ND, weight_VD, targets_N)
        ctx.temperature, ctx.chunk, ctx.cap = temperature, chunk, cap
        # A capped head's backward needs the logits themselves: it recomputes every chunk.
        keep = cap is None and any(ctx.needs_input_grad[:2])
        ctx.last_logp_CV = logp_CV if keep else None
        entropy_N = _cat(entropies, hidden_ND)
        ctx.mark_non_differentiable(entropy_N)
        return _cat(logprobs, hidden_ND), entropy_N

    @staticmethod
    def backward(ctx, grad_N, _grad_entropy_N):
        hidden_ND, weight_VD, targets_N = ctx.saved_tensors
        T, chunk, cap = ctx.temperature, ctx.chunk, ctx.cap
        grad_hidden = torch.empty_like(hidden_ND)
        grad_weight = torch.zeros(weight_VD.shape, dtype=torch.float32, device=weight_VD.device)
        # Last chunk first: its log_softmax was kept.
        for start in reversed(range(0, hidden_ND.shape[0], chunk)):
            rows = slice(start, start + chunk)
            hidden_CD = hidden_ND[rows]
            slope_CV = None
            if ctx.last_logp_CV is not None:
                probs_CV, ctx.last_logp_CV = ctx.last_logp_CV.exp_(), None
            else:
                logits_CV = _head_logits(hidden_CD, weight_VD)
                if cap is not None:
                    logits_CV, slope_CV = cap.with_slope(logits_CV)
                probs_CV = torch.softmax(_scaled(logits_CV, T), dim=-1)
                del logits_CV
            # d logp(target) / d logits = onehot(target) - softmax, times 1 / T.
            grad_CV = probs_CV.neg_()
            grad_CV.scatter_add_(-1, targets_N[rows, None], torch.ones_like(grad_N[rows, None]))
            grad_CV.mul_(grad_N[rows, None].float() / T)
            if slope_CV is not None:  # through the cap, back to the projection's logits
                grad_CV.mul_(slope_CV)
                del slope_CV
            grad_hidden[rows] = _project_back(grad_CV, hidden_CD, weight_VD, grad_weight)
            del probs_CV, grad_CV
        return grad_hidden, grad_weight.to(weight_VD.dtype), None, None, None, None


class _VocabParallelHeadLogprobs(torch.autograd.Function):
    """`_HeadLogprobs` over a vocabulary sharded across the ranks of `group` (trainer TP): this
    rank holds rows `first .. first + V_local` of the output projection. Each chunk's logits
    stay [C, V_local]; the softmax's max and normalizer, the target's logit and the entropy are
    all-reduced over `group` ([C] figures each), and backward all-reduces the hidden states'
    gradient (each rank holds its share, summed in fp32). The hidden states must be the same
    on every rank. GEMMs in the compute dtype, as `_HeadLogprobs`."""

    @staticmethod
    def forward(ctx, hidden_ND, weight_VD, targets_N, temperature, chunk, group, first, cap):
        rows = weight_VD.shape[0]
        mine_N = (targets_N >= first) & (targets_N < first + rows)
        local_N = (targets_N - first).clamp(0, rows - 1)
        logprobs, entropies, maxima, log_norms = [], [], [], []
        for start in range(0, hidden_ND.shape[0], chunk):
            span = slice(start, start + chunk)
            logits_CV = _scaled(_capped(F.linear(hidden_ND[span], weight_VD), cap), temperature)
            max_C = logits_CV.max(-1).values
            dist.all_reduce(max_C, op=dist.ReduceOp.MAX, group=group)
            shifted_CV = logits_CV.sub_(max_C[:, None])
            target_C = shifted_CV.gather(-1, local_N[span, None]).squeeze(-1) * mine_N[span]
            sums_2C = torch.stack([shifted_CV.exp().sum(-1), target_C])
            dist.all_reduce(sums_2C, group=group)
            log_norm_C = sums_2C[0].log()
            logp_CV = shifted_CV.sub_(log_norm_C[:, None])
            entropy_C = _entropy(logp_CV)
            dist.all_reduce(entropy_C, group=group)
            logprobs.append(sums_2C[1] - log_norm_C)
            entropies.append(entropy_C)
            maxima.append(max_C)
            log_norms.append(log_norm_C)
            del logits_CV, shifted_CV, logp_CV
        max_N, log_norm_N = _cat(maxima, hidden_ND), _cat(log_norms, hidden_ND)
        ctx.save_for_backward(hidden_ND, weight_VD, local_N, mine_N, max_N, log_norm_N)
        ctx.temperature, ctx.chunk, ctx.group, ctx.cap = temperature, chunk, group, cap
        entropy_N = _cat(entropies, hidden_ND)
        ctx.mark_non_differentiable(entropy_N)
        return _cat(logprobs, hidden_ND), entropy_N

    @staticmethod
    def backward(ctx, grad_N, _grad_entropy_N):
        hidden_ND, weight_VD, local_N, mine_N, max_N, log_norm_N = ctx.saved_tensors
        T, chunk, cap = ctx.temperature, ctx.chunk, ctx.cap
        grad_hidden = torch.empty(hidden_ND.shape, dtype=torch.float32, device=hidden_ND.device)
        grad_weight = torch.zeros(weight_VD.shape, dtype=torch.float32, device=weight_VD.device)
        for start in range(0, hidden_ND.shape[0], chunk):
            span = slice(start, start + chunk)
            hidden_CD = hidden_ND[span]
            logits_CV, slope_CV = F.linear(hidden_CD, weight_VD), None
            if cap is not None:
                logits_CV, slope_CV = cap.with_slope(logits_CV)
            logits_CV = _scaled(logits_CV, T)
            # This rank's share of softmax, from the forward's all-reduced max and normalizer.
            grad_CV = logits_CV.sub_((max_N[span] + log_norm_N[span])[:, None]).exp_().neg_()
            onehot_C = mine_N[span, None].to(grad_CV.dtype)
            grad_CV.scatter_add_(-1, local_N[span, None], onehot_C)
            grad_CV.mul_(grad_N[span, None].float() / T)
            if slope_CV is not None:
                grad_CV.mul_(slope_CV)
            grad_hidden[span] = _project_back(grad_CV, hidden_CD, weight_VD, grad_weight)
            del logits_CV, grad_CV
        dist.all_reduce(grad_hidden, group=ctx.group)  # each rank's vocabulary rows' share
        grad_hidden, grad_weight = grad_hidden.to(hidden_ND.dtype), grad_weight.to(weight_VD.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None


def _scaled(logits_CV: torch.Tensor, temperature: float) -> torch.Tensor:
    logits_CV = logits_CV.float()
    return logits_CV.div_(temperature) if temperature != 1.0 else logits_CV


def _cat(pieces: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    if not pieces:
        return torch.zeros(0, dtype=torch.float32, device=like.device)
    return torch.cat(pieces)


def head_weight(head: torch.nn.Module) -> tuple[torch.Tensor, dist.ProcessGroup | None, int]:
    """The output projection `head`'s weight for `head_logprobs`, as its forward sees it:
    FSDP's unsharded copy (inside `fused_head`, FSDP's hooks have gathered it; outside,
    `unshard` gathers it). Under TP, this rank's rows of the vocabulary, the TP group and the
    first row's index: the head then runs vocabulary-parallel and the weight is never
    gathered; except under batch-invariant mode, whose logprobs are those of one device's
    head over the whole vocabulary (the vocabulary-parallel softmax reduces in another
    order): the weight is gathered (its gradient each rank's rows of the whole one's)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, Shard

    if isinstance(head, FSDPModule):
        head.unshard()
    weight = head.weight
    if not isinstance(weight, DTensor):
        return weight, None, 0
    batch_invariant = sys.modules.get("torchtitan_rl.batch_invariant")  # see `_head_logits`
    invariant = batch_invariant is not None and batch_invariant.is_enabled()
    if weight.device_mesh.ndim == 1 and weight.placements == (Shard(0),) and not invariant:
        mesh = weight.device_mesh
        rows = -(-weight.shape[0] // mesh.size())  # Shard(0) splits as torch.chunk does
        return weight.to_local(), mesh.get_group(), mesh.get_local_rank() * rows
    return weight.full_tensor(), None, 0


def fused_head(
    head: torch.nn.Module,
    hidden_ND: torch.Tensor,
    targets_N: torch.Tensor,
    temperature: float = 1.0,
    *,
    budget_mib: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`head_logprobs` of the output projection module `head` (its weight, soft cap, TP
    shard), run as a call of `head` itself: FSDP's forward hooks on the module unshard its
    weight, complete its group's forward and, after backward, reduce-scatter the weight's
    gradient and reshard it, as they do for torchtitan's own forward (a head used outside its
    hooks is never resharded by FSDP and, on torch 2.11, warns every step). The module's own
    forward (and torchtitan's TP redistribution around it) is swapped out for the call: the
    fused head reads this rank's vocabulary rows directly. `budget_mib`: `head_chunk`'s."""

    def forward(hidden_ND: torch.Tensor, targets_N: torch.Tensor):
        weight, group, first = head_weight(head)
        return head_logprobs(
            hidden_ND,
            weight,
            targets_N,
            temperature,
            chunk=head_chunk(weight.shape[0], budget_mib),
            group=group,
            first=first,
            cap=soft_cap(head),
        )

    own = head.__dict__.get("forward")  # torchtitan's TP wrapper, when parallelized
    head.forward = forward
    try:
        return head(hidden_ND, targets_N)
    finally:
        if own is None:
            del head.forward
        else:
            head.forward = own


def head_logprobs(
    hidden_ND: torch.Tensor,
    weight_VD: torch.Tensor,
    targets_N: torch.Tensor,
    temperature: float = 1.0,
    *,
    chunk: int | None = None,
    group: dist.ProcessGroup | None = None,
    first: int = 0,
    cap: SoftCap | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs [N] (fp32, with gradient to `hidden_ND` and `weight_VD`) and entropies [N] (no
    gradient) of `targets_N` under the output projection `weight_VD` of the final hidden
    states `hidden_ND`, at temperature T.

    Fuses projection -> log_softmax -> gather per chunk of `chunk` tokens: the same ops, in the
    same order, as `token_logprobs` on full logits, so equal hidden states give equal bits in
    the forward; backward recomputes each chunk, so memory is one [chunk, V] block, not
    [N, V] logits and their gradient. `chunk`: tokens per chunk (default `head_chunk(V)`).

    With `group` (trainer TP), `weight_VD` is this rank's rows of a vocabulary sharded over the
    group, starting at row `first`: each chunk's logits stay sharded ([chunk, V / tp]) and only
    [chunk]-sized figures cross ranks (`_VocabParallelHeadLogprobs`). Not bitwise equal to the
    unsharded head (the softmax is reduced in another order): under batch-invariant mode a TP
    trainer's head gets the gathered weight instead (`head_weight`).

    `cap`: the head's transform of its logits (`soft_cap(lm_head)`: Muse Glimmer's tanh cap),
    applied to each chunk's logits before the softmax and differentiated through in backward.
    """
    chunk = chunk or head_chunk(weight_VD.shape[0])  # a chunk's block: [chunk, V_local]
    if group is not None:
        return _VocabParallelHeadLogprobs.apply(
            hidden_ND, weight_VD, targets_N, temperature, chunk, group, first, cap
        )
    return _HeadLogprobs.apply(hidden_ND, weight_VD, targets_N, temperature, chunk, cap)
