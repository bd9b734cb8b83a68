"""Packed micro-batches: first-fit decreasing under a token budget, document-causal attention,
the chunked LM head, and the packed trainer against the padded one (loss, gradients, bits).

.venv/bin/python -m pytest tests/unit/test_packing.py
"""

import random

import pytest
import torch
import torch.nn.functional as F
from helpers.batches import recorded_grads
from helpers.launch import REPO

from torchtitan_rl import batch_invariant, platform
from torchtitan_rl.algorithms.losses import AGGREGATIONS, PolicyLoss
from torchtitan_rl.config import ModelSection, ParallelismSection, TrainingSection
from torchtitan_rl.trainer import attention, logprobs, packing
from torchtitan_rl.trainer.logprobs import SoftCap, head_logprobs, token_logprobs
from torchtitan_rl.trainer.policy_trainer import PolicyTrainer
from torchtitan_rl.types import RolloutBatch

TINY = REPO / "assets" / "tiny_qwen3"


@pytest.fixture(scope="module", autouse=True)
def _world_of_one():
    platform.patch_torchtitan()
    platform.init_distributed()


# ---- packing ------------------------------------------------------------------------------


def test_first_fit_decreasing_fills_rows_within_the_budget_and_is_deterministic():
    rng = random.Random(0)
    lengths = [rng.randint(0, 90) for _ in range(200)]
    groups = packing.first_fit_decreasing(lengths, 100)
    assert groups == packing.first_fit_decreasing(list(lengths), 100)
    assert sorted(i for g in groups for i in g) == [i for i, n in enumerate(lengths) if n > 0]
    assert all(sum(lengths[i] for i in g) <= 100 for g in groups)
    # FFD is within 11/9 OPT + 1 of the fewest rows; the mean fill here is over 90%.
    assert sum(lengths) / (100 * len(groups)) > 0.9
    with pytest.raises(ValueError, match="a sequence of 101 tokens exceeds the budget of 100"):
        packing.first_fit_decreasing([5, 101], 100)


def test_split_to_reaches_the_count_keeping_every_row_once():
    lengths = [30, 20, 10, 5]
    split = packing.split_to([[0, 1, 2, 3]], lengths, 3)
    assert len(split) == 3 and sorted(i for g in split for i in g) == [0, 1, 2, 3]
    # Single rows cannot split: empty micro-batches make up the count.
    assert packing.split_to([[0], [1]], lengths, 4) == [[0], [1], [], []]


def test_runs_group_consecutive_documents_of_one_length():
    docs = attention.documents([9, 9, 9, 4, 4, 1, 9], torch.device("cpu"))
    assert attention.runs(docs) == [(0, 9, 3), (27, 4, 2), (35, 1, 1), (36, 9, 1)]


def test_needed_runs_each_row_through_its_last_scored_token():
    mask_BT = torch.tensor([[0, 0, 1, 1, 0, 0], [0, 1, 0, 0, 0, 1], [0, 0, 0, 0, 0, 0.0]])
    assert packing.needed(mask_BT) == [4, 6, 0]


def test_rebalance_evens_long_tailed_loads_moving_few_rows():
    rng = random.Random(1)
    ranks = [[int(min(4096, rng.lognormvariate(5.3, 1.2))) for _ in range(16)] for _ in range(4)]
    shares = packing.rebalance(ranks)
    loads = [sum(ranks[r][i] for r, i in share) for share in shares]
    assert sorted(pair for share in shares for pair in share) == [
        (r, i) for r in range(4) for i in range(16)
    ]
    assert max(loads) <= 1.1 * min(loads)
    moved = sum(r != rank for rank, share in enumerate(shares) for r, _ in share)
    assert 0 < moved <= 16
    # Loads that already balance move nothing: the uniform case costs no exchange.
    assert packing.rebalance([[128] * 8, [128] * 8]) == [
        [(0, i) for i in range(8)],
        [(1, i) for i in range(8)],
    ]


# ---- kernels ------------------------------------------------------------------------------


@pytest.mark.parametrize("lengths", [[7, 1, 20, 12], [9, 9, 9, 4, 4, 1, 9]])
def test_packed_attention_equals_each_document_alone(lengths):
    g = torch.Generator().manual_seed(0)
    L, N, K, H = sum(lengths), 4, 2, 16
    q = torch.randn(1, L, N, H, generator=g)
    k, v = (torch.randn(1, L, K, H, generator=g) for _ in range(2))
    docs = attention.documents(lengths, torch.device("cpu"))
    alone = torch.cat(
        [
            attention.causal_sdpa(q[:, s:e], k[:, s:e], v[:, s:e], enable_gqa=True)
            for s, e in attention.spans(docs)
        ],
        dim=1,
    )
    per_doc = attention.sdpa_per_document(q, k, v, docs, enable_gqa=True)
    masked = attention.masked_sdpa(q, k, v, docs, enable_gqa=True)
    # Runs of equal lengths go as one batch: the same kernel per row, up to rounding.
    torch.testing.assert_close(per_doc, alone, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(masked, alone, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("temperature", "cap"),
    [(1.0, None), (0.7, None), (1.0, SoftCap(4.0, 3.0)), (0.7, SoftCap(2.0, None))],
)
def test_chunked_head_equals_full_logits_in_value_and_gradient(temperature, cap):
    """The fused head against full logits through autograd; with a soft cap (Muse Glimmer's
    head: `3 tanh(4 z / 3)`, logits of ~1.2 bent well into the tanh), against the cap's own
    torch ops, so that its hand-written backward is checked by autograd's."""
    g = torch.Generator().manual_seed(0)
    N, D, V = 37, 16, 50
    hidden = torch.randn(N, D, generator=g, dtype=torch.float64).float().requires_grad_()
    weight = (0.3 * torch.randn(V, D, generator=g)).requires_grad_()
    targets = torch.randint(0, V, (N,), generator=g)
    upstream = torch.randn(N, generator=g)

    # Reference: full logits, then token_logprobs' alignment (a leading column).
    logits_1NV = F.linear(hidden, weight)[None]
    if cap is not None:
        logits_1NV = cap(logits_1NV)
    tokens_1N = torch.cat([torch.zeros(1, dtype=torch.long), targets])[None]
    padded_1NV = torch.cat([logits_1NV, torch.zeros(1, 1, V)], dim=1)
    ref, ref_entropy = token_logprobs(padded_1NV, tokens_1N, temperature, with_entropy=True)
    (ref[0, 1:] * upstream).sum().backward()
    ref_grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    logprobs, entropy = head_logprobs(hidden, weight, targets, temperature, chunk=8, cap=cap)
    (logprobs * upstream).sum().backward()
    torch.testing.assert_close(logprobs, ref[0, 1:].detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(entropy, ref_entropy[0, 1:], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(hidden.grad, ref_grads[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weight.grad, ref_grads[1], rtol=1e-5, atol=1e-6)
    assert not entropy.requires_grad


def test_the_head_chunk_is_bounded_in_bytes_at_a_large_vocabulary(monkeypatch):
    """Qwen3's vocabulary gets chunks of at most CHUNK_ELEMENTS fp32 logits; a small one keeps
    HEAD_CHUNK tokens. With the bound lowered to 8 rows of a 50-entry vocabulary, every head
    projection (forward and recomputed backward) sees at most 8 rows, and the result equals
    an explicit chunk of 8."""
    assert logprobs.head_chunk(151_936) * 151_936 <= logprobs.CHUNK_ELEMENTS
    assert logprobs.head_chunk(151_936) >= 256  # still a GEMM of many rows
    assert logprobs.head_chunk(2048) == logprobs.HEAD_CHUNK

    g = torch.Generator().manual_seed(1)
    N, D, V = 29, 8, 50
    hidden = torch.randn(N, D, generator=g).requires_grad_()
    weight = torch.randn(V, D, generator=g).requires_grad_()
    targets = torch.randint(0, V, (N,), generator=g)
    explicit, _ = head_logprobs(hidden, weight, targets, chunk=8)
    explicit.sum().backward()
    explicit_grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    rows_seen = []
    linear = F.linear
    monkeypatch.setattr(logprobs, "CHUNK_ELEMENTS", 8 * V)
    monkeypatch.setattr(
        logprobs.F, "linear", lambda x, w: rows_seen.append(x.shape[0]) or linear(x, w)
    )
    default, _ = head_logprobs(hidden, weight, targets)
    default.sum().backward()
    assert max(rows_seen) == 8 and sum(rows_seen) >= N  # the forward covers every token
    assert torch.equal(default, explicit)
    assert torch.equal(hidden.grad, explicit_grads[0])
    assert torch.equal(weight.grad, explicit_grads[1])


def test_the_head_chunk_budget_sets_the_tokens_per_gemm(monkeypatch):
    """training.head_chunk_mib acts: `fused_head` projects chunks of budget / (4 V) tokens (a
    262,144-entry vocabulary: 1 token per MiB), the same logprobs whatever the budget, and
    the trainer takes the field, or the platform's default when it is 0."""
    g = torch.Generator().manual_seed(2)
    N, D, V = 9, 8, 2**18
    head = torch.nn.Linear(D, V, bias=False)
    hidden = torch.randn(N, D, generator=g)
    targets = torch.randint(0, V, (N,), generator=g)
    rows_seen, linear = [], F.linear
    monkeypatch.setattr(
        logprobs.F, "linear", lambda x, w: rows_seen.append(x.shape[0]) or linear(x, w)
    )
    results = {}
    for budget in (1, 4):
        rows_seen.clear()
        results[budget], _ = logprobs.fused_head(head, hidden, targets, budget_mib=budget)
        assert rows_seen == [budget] * (N // budget) + [N % budget] * (N % budget > 0)
    # Equal up to the GEMM's last bits: a 1-row and a 4-row product may round differently
    # (measured 2 ulps, 1.9e-6 at a logprob of -12.8, with the other xdist worker busy).
    torch.testing.assert_close(results[1], results[4], rtol=1e-6, atol=1e-6)
    assert trainer(0).head_chunk_mib == platform.head_chunk_mib() == 256
    assert (
        PolicyTrainer(
            model=ModelSection(hf_checkpoint=str(TINY)),
            training=TrainingSection(head_chunk_mib=3),
            parallelism=ParallelismSection(),
        ).head_chunk_mib
        == 3
    )


# ---- the trainer: packed against padded -----------------------------------------------------


def trainer(micro_batch_tokens: int, micro_batches: int = 1) -> PolicyTrainer:
    return PolicyTrainer(
        model=ModelSection(hf_checkpoint=str(TINY)),
        training=TrainingSection(
            micro_batch_tokens=micro_batch_tokens, micro_batches=micro_batches, lr=1e-3
        ),
        parallelism=ParallelismSection(),
        temperature=0.9,
    )


def ragged_batch(seed: int = 0, rows: int = 9) -> RolloutBatch:
    """Right-padded rows of 3 to 40 tokens: a prompt, then sampled tokens (loss mask 1)."""
    g = torch.Generator().manual_seed(seed)
    width = 40
    tokens_BT = torch.zeros(rows, width, dtype=torch.long)
    mask_BT = torch.zeros(rows, width)
    for b in range(rows):
        prompt = int(torch.randint(2, 12, (1,), generator=g))
        length = int(torch.randint(prompt + 1, width + 1, (1,), generator=g))
        tokens_BT[b, :length] = torch.randint(3, 64, (length,), generator=g)
        mask_BT[b, prompt:length] = 1.0
    return RolloutBatch(
        tokens_BT=tokens_BT,
        loss_mask_BT=mask_BT,
        advantages_B=torch.randn(rows, generator=g),
        generator_logprobs_BT=-torch.rand(rows, width, generator=g) * mask_BT,
        reference_logprobs_BT=-torch.rand(rows, width, generator=g) * mask_BT,
        old_logprobs_BT=-torch.rand(rows, width, generator=g) * mask_BT,
    )


def step_grads(t: PolicyTrainer, batch: RolloutBatch, loss) -> tuple[dict, dict]:
    with recorded_grads(t) as grads:
        result = t.optimizer_step(batch, loss)
    return result.metrics, grads


LOSSES = {
    **{
        aggregation: dict(aggregation=aggregation)
        for aggregation in AGGREGATIONS
        if aggregation != "token_mean"
    },
    "token_mean+kl": dict(aggregation="token_mean", kl_beta=0.1),
    "gspo": dict(level="sequence", aggregation="seq_mean_token_mean"),
}


@pytest.fixture(scope="module")
def packed_and_padded():
    # Budget 64: the 9 ragged rows pack into several micro-batches.
    return trainer(64), trainer(0, micro_batches=3)


@pytest.mark.parametrize("name", list(LOSSES))
def test_packed_loss_and_gradients_equal_the_padded_ones(packed_and_padded, name):
    loss = PolicyLoss(clip_low=0.2, clip_high=0.2, max_tokens=40, **LOSSES[name])
    batch = ragged_batch()
    packed, padded = packed_and_padded
    # Both start from the checkpoint; compare one step's loss and gradients.
    for t in (packed, padded):
        t.model.load_state_dict(initial_state(t))
    assert len(packed.micro_batches(batch)) > 1
    packed_metrics, packed_grads = step_grads(packed, batch, loss)
    padded_metrics, padded_grads = step_grads(padded, batch, loss)
    assert packed_metrics["tokens"] == padded_metrics["tokens"]
    assert packed_metrics["loss"] == pytest.approx(padded_metrics["loss"], rel=1e-6)
    assert packed_metrics["entropy"] == pytest.approx(padded_metrics["entropy"], rel=1e-6)
    for param, grad in padded_grads.items():
        error = float((packed_grads[param] - grad).norm() / grad.norm())
        assert error < 1e-6, f"{param}: relative gradient error {error:.2e}"


_INITIAL: dict[int, dict] = {}


def initial_state(t: PolicyTrainer) -> dict:
    if id(t) not in _INITIAL:
        _INITIAL[id(t)] = {k: v.detach().clone() for k, v in t.model.state_dict().items()}
    return _INITIAL[id(t)]


def test_packed_logprobs_score_only_the_masked_tokens(packed_and_padded):
    packed, padded = packed_and_padded
    batch = ragged_batch(seed=3)
    mask_BT = batch.loss_mask_BT
    packed_BT, packed_entropy_BT = packed.logprobs(batch.tokens_BT, mask_BT)
    padded_BT, padded_entropy_BT = padded.logprobs(batch.tokens_BT)
    torch.testing.assert_close(packed_BT, padded_BT * mask_BT, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(packed_entropy_BT, padded_entropy_BT * mask_BT, rtol=1e-6, atol=1e-6)
    assert bool((packed_BT[mask_BT == 0] == 0).all())


def test_under_batch_invariance_a_sequence_gets_the_same_bits_however_it_is_packed(monkeypatch):
    monkeypatch.setattr(batch_invariant, "_enabled", True)
    t = PolicyTrainer(
        model=ModelSection(hf_checkpoint=str(TINY)),
        training=TrainingSection(micro_batch_tokens=4096),
        parallelism=ParallelismSection(),
    )
    batch = ragged_batch(seed=5, rows=12)
    mask_BT = batch.loss_mask_BT
    together_BT, _ = t.logprobs(batch.tokens_BT, mask_BT)
    for budget in (40, 64, 150):  # different rows, neighbours and positions in a row
        t.micro_batch_tokens = budget
        again_BT, _ = t.logprobs(batch.tokens_BT, mask_BT)
        assert torch.equal(again_BT, together_BT), budget
    t.micro_batch_tokens = 4096
    for b in (0, 7, 11):  # alone, in the other order
        alone_BT, _ = t.logprobs(batch.tokens_BT[b : b + 1], mask_BT[b : b + 1])
        assert torch.equal(alone_BT[0], together_BT[b]), b
    reversed_BT, _ = t.logprobs(batch.tokens_BT.flip(0), mask_BT.flip(0))
    assert torch.equal(reversed_BT.flip(0), together_BT)
    # ... and the bits of the padded path's full logits.
    t.micro_batch_tokens = 0
    padded_BT, _ = t.logprobs(batch.tokens_BT)
    assert torch.equal(padded_BT * mask_BT, together_BT)
