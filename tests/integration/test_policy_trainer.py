"""PolicyTrainer under real torchrun: FSDP=2 matches one process, micro-batching matches one batch.

.venv/bin/python -m pytest tests/integration/test_policy_trainer.py
"""

import collections
import json

import pytest
import torch
from helpers.batches import fixed_batch
from helpers.host_syncs import HOST_PLANNERS
from helpers.launch import REPO, run_dist

TINY = REPO / "assets" / "tiny_qwen3"


def worlds(tmp_path_factory, nproc: int, *layouts: tuple) -> list[dict]:
    """One launch of tests/dist/policy_trainer_run.py with `nproc` ranks (0: a plain process)
    for several (micro-batches, activation_checkpoint, tp[, replicas]) layouts: rank 0's result
    of each. Micro-batches: a count of padded ones, or "bN", packed under a budget of N tokens;
    replicas: HSDP's parallelism.dp_replicate."""
    out = tmp_path_factory.mktemp(f"policy_trainer_w{nproc}")
    names = [",".join(map(str, layout)) for layout in layouts]
    run_dist("policy_trainer_run.py", str(out), *names, nproc=nproc)
    results = []
    for m, c, tp, *replicas in layouts:
        suffix = f"_r{replicas[0]}" if replicas else ""
        results.append(torch.load(out / f"{m}_{c}_tp{tp}{suffix}.pt".replace(":", "_")))
    if nproc == 2:  # and the vocabulary-parallel head's comparison
        results.append(torch.load(out / "head.pt"))
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Results keyed by (ranks, micro-batches[, activation checkpointing[, "tp2"]])."""
    single, selective, single_packed = worlds(
        tmp_path_factory, 0, (1, "none", 1), (1, "selective", 1), ("b16", "none", 1)
    )
    fsdp, fsdp_micro, fsdp_full, tp, fsdp_packed, tp_packed, hybrid, hybrid_tp, moe, head = worlds(
        tmp_path_factory,
        2,
        (1, "none", 1),
        (4, "none", 1),
        (2, "full", 1),
        (2, "full", 2),
        ("b16", "none", 1),
        ("b24", "full", 2),
        ("qwen3_5:1", "none", 1),
        ("qwen3_5:b24", "full", 2),
        ("moe:b24", "none", 1),
    )
    # HSDP on 4 ranks: 2 replicas x 2 FSDP shards, each rank 2 of the 8 rows.
    (hsdp,) = worlds(tmp_path_factory, 4, (1, "none", 1, 2))
    return {
        (1, 1): single,
        (2, 1): fsdp,
        (2, 4): fsdp_micro,
        (2, 2, "full"): fsdp_full,
        (1, 1, "selective"): selective,
        # Tensor parallel over both ranks (FSDP degree 1): the ranks share one batch.
        (2, 2, "full", "tp2"): tp,
        # Packed under a budget of 16 (24) tokens: rows of 6 to 11 tokens, 1 to 3 per row.
        (1, "b16"): single_packed,
        (2, "b16"): fsdp_packed,
        (2, "b24", "full", "tp2"): tp_packed,
        (4, 1, "hsdp"): hsdp,
        "head": head,
        # The tiny Qwen3.5 (three Gated DeltaNet layers): FSDP, and TP packed, checkpointed.
        ("qwen3_5", 2, 1): hybrid,
        ("qwen3_5", 2, "b24", "full", "tp2"): hybrid_tp,
        # The tiny Qwen3-MoE, its experts split over both ranks (EP 2), packed, rows dealt.
        ("moe", 2, "b24", "ep2"): moe,
    }


def test_fsdp2_shards_parameters(runs):
    local = runs[(2, 1)]["local_shapes"]
    full = runs[(2, 1)]["params"]
    assert local["layers.0.feed_forward.w1.weight"] == (128, 128)
    assert full["layers.0.feed_forward.w1.weight"].shape == (256, 128)
    assert runs[(2, 1)]["params_are_views"]  # weight sync gets the live DTensors, no copies
    # HSDP (2 replicas x 2 shards): each replica shards like FSDP over 2; 4 data ranks.
    hsdp = runs[(4, 1, "hsdp")]
    assert hsdp["local_shapes"]["layers.0.feed_forward.w1.weight"] == (128, 128)
    assert hsdp["share"][1] == 4 and hsdp["params_are_views"]


def test_fsdp2_logprobs_equal_single_process(runs):
    single, fsdp = runs[(1, 1)], runs[(2, 1)]
    torch.testing.assert_close(fsdp["logprobs_BT"], single["logprobs_BT"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fsdp["entropy_BT"], single["entropy_BT"], rtol=1e-5, atol=1e-6)
    assert bool((single["logprobs_BT"][:, 0] == 0).all())


def test_logprobs_match_transformers_at_the_trainer_temperature(runs):
    from transformers import AutoModelForCausalLM

    tokens_BT = fixed_batch().tokens_BT
    with torch.no_grad():
        logits_BTV = AutoModelForCausalLM.from_pretrained(TINY)(tokens_BT).logits
    # The run scores under temperature 0.7; logits at t score token t + 1.
    logp_BTV = torch.log_softmax(logits_BTV[:, :-1] / 0.7, dim=-1)
    expected_BT = logp_BTV.gather(-1, tokens_BT[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(
        runs[(2, 1)]["logprobs_BT"][:, 1:], expected_BT, rtol=1e-5, atol=1e-5
    )


def adamw_first_step(before: torch.Tensor, grad: torch.Tensor, lr: float = 1e-2) -> torch.Tensor:
    """torch's AdamW after one step (betas 0.9, 0.999, eps 1e-8, no weight decay): the moments
    are (1 - beta) g and (1 - beta2) g^2, the bias corrections undo the (1 - beta)s."""
    g = grad.double()
    denom = (0.001 * g * g).sqrt() / 0.001**0.5 + 1e-8
    return (before.double() - lr * (0.1 * g) / 0.1 / denom).float()


PACKED = [(1, "b16"), (2, "b16"), (2, "b24", "full", "tp2")]


@pytest.mark.parametrize(
    "other",
    [
        (2, 1),
        (2, 4),
        (2, 2, "full"),
        (1, 1, "selective"),
        (2, 2, "full", "tp2"),
        (4, 1, "hsdp"),
        *PACKED,
    ],
)
def test_step_is_the_same_for_any_parallelism_micro_batches_and_checkpointing(runs, other):
    reference, candidate = runs[(1, 1)], runs[other]
    assert candidate["metrics"]["tokens"] == reference["metrics"]["tokens"] == 32
    assert candidate["metrics"]["masked_tokens"] == 32  # metrics sum over ranks
    assert candidate["metrics"]["loss"] == pytest.approx(reference["metrics"]["loss"], rel=1e-5)
    assert candidate["metrics"]["grad_norm"] == pytest.approx(
        reference["metrics"]["grad_norm"], rel=1e-5
    )
    for name, grad in reference["grads"].items():
        torch.testing.assert_close(candidate["grads"][name], grad, rtol=1e-4, atol=1e-6)
    # AdamW's first step moves a weight by lr * g / (|g| + eps), about lr * sign(g): rounding
    # noise in a near-zero gradient (its sign differs between CPUs: AVX2, AVX-512) moves it by
    # up to lr. So each run's update is checked against AdamW applied to its own gradient, on
    # every weight, and the weights are compared across runs where |g| is far above that noise.
    for name, weight in reference["weights_after"].items():
        for run in (reference, candidate):
            expected = adamw_first_step(run["weights_before"][name], run["grads"][name])
            torch.testing.assert_close(run["weights_after"][name], expected, rtol=0, atol=1e-6)
        clear = reference["grads"][name].abs() > 1e-4  # 100x the gradients' atol above
        assert clear.float().mean() > 0.5, name  # most weights are compared
        torch.testing.assert_close(
            candidate["weights_after"][name][clear], weight[clear], rtol=0, atol=1e-6
        )
    assert reference["params"].keys() == candidate["params"].keys()


def test_qwen3_5_under_tensor_parallel_splits_its_gated_deltanet_heads_and_takes_the_same_step(
    runs,
):
    """Trainer TP on the tiny Qwen3.5: each rank holds half of every Gated DeltaNet layer's
    key and value heads (its input projections, convolution channels, A_log and dt_bias; the
    output projection's input half), runs their convolution and recurrence per document of a
    packed row, and the step equals FSDP's on padded rows."""
    reference, candidate = runs[("qwen3_5", 2, 1)], runs[("qwen3_5", 2, "b24", "full", "tp2")]
    local, whole = candidate["local_shapes"], candidate["params"]
    for name in ("in_proj_q", "in_proj_k", "in_proj_v", "in_proj_z", "in_proj_a", "in_proj_b"):
        key = f"layers.0.attn.{name}.weight"
        assert local[key][0] * 2 == whole[key].shape[0], key
    for name in ("conv_q.weight", "conv_v.weight", "A_log", "dt_bias"):
        key = f"layers.0.attn.{name}"
        assert local[key][0] * 2 == whole[key].shape[0], key
    out = "layers.0.attn.out_proj.weight"
    assert local[out][1] * 2 == whole[out].shape[1]
    assert all(len(forwards) == 3 for forwards in candidate["forwards"])  # packed rows
    torch.testing.assert_close(
        candidate["logprobs_BT"], reference["logprobs_BT"], rtol=1e-6, atol=1e-6
    )
    assert candidate["metrics"]["loss"] == pytest.approx(reference["metrics"]["loss"], rel=1e-5)
    assert candidate["metrics"]["grad_norm"] == pytest.approx(
        reference["metrics"]["grad_norm"], rel=1e-5
    )
    assert reference["grads"].keys() == candidate["grads"].keys()
    for name, grad in reference["grads"].items():
        torch.testing.assert_close(candidate["grads"][name], grad, rtol=1e-4, atol=1e-6)
    assert reference["grads"]["layers.0.attn.A_log"].abs().min() > 0


def test_the_step_moved_the_weights(runs):
    from safetensors.torch import load_file

    before = load_file(TINY / "model.safetensors")["model.layers.0.mlp.gate_proj.weight"]
    after = runs[(2, 4)]["params"]["layers.0.feed_forward.w1.weight"]
    assert (after - before).abs().max() > 5e-3  # about lr = 1e-2 for AdamW's first step


@pytest.mark.parametrize(
    "key", [(1, 1), (2, 1), (2, 4), (2, 2, "full"), (2, 2, "full", "tp2"), (4, 1, "hsdp")]
)
def test_the_step_reports_pre_update_logprobs_from_its_own_forwards(runs, key):
    """One forward per micro-batch and no more: the logprobs logprob_diff compares come from
    the step's own forwards, and equal a separate scoring pass of the same weights."""
    run = runs[key]
    micro_batches = key[1]
    assert all(len(forwards) == micro_batches for forwards in run["forwards"])
    rank, ranks = run["share"]
    share_BT = run["logprobs_BT"].tensor_split(ranks)[rank]
    torch.testing.assert_close(run["step_logprobs_BT"], share_BT, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "key", [(1, 1), (2, 1), (2, 4), (2, 2, "full", "tp2"), (1, "b16"), (2, "b16"), (4, 1, "hsdp")]
)
def test_the_head_runs_inside_its_fsdp_hooks_and_is_resharded_after_the_step(runs, key):
    """Issue 66: the fused head of the packed path is a call of the lm_head module (FSDP's
    hooks gather its weight, complete its group's forward, reduce-scatter its gradient; on
    torch 2.11 a head used outside them warned every step): one call per micro-batch, as the
    padded path's full-logits forward makes. After the step FSDP has resharded it: each rank
    holds its rows (half of the vocabulary on 2 FSDP ranks), not the gathered weight. Its
    gradient equals the full-logits path's: `test_step_is_the_same_for_any_parallelism...`
    compares every gradient, the head's included, of the packed runs with one padded
    process."""
    run = runs[key]
    assert run["head_calls"] == len(run["forwards"][0])
    vocab = json.loads((TINY / "config.json").read_text())["vocab_size"]
    kind, shape = run["head_after_step"]
    shards = {(1, 1): 1, (1, "b16"): 1, (2, 1): 2, (2, 4): 2, (2, "b16"): 2, (4, 1, "hsdp"): 2}
    if "tp2" in key:  # the vocabulary split over the TP ranks, as the step left it
        assert (kind, shape[0]) == ("DTensor", vocab // 2)
    elif shards[key] == 1:
        assert shape[0] == vocab
    else:
        assert (kind, shape[0]) == ("DTensor", vocab // shards[key])


@pytest.mark.parametrize("key", PACKED)
def test_packed_steps_run_each_sequence_once_within_the_budget_balanced_over_ranks(runs, key):
    """Each forward is one packed row within the budget; every rank runs as many; together
    they run each sequence through its last scored token once (64 tokens, no padding); the
    data-parallel ranks' loads balance (the FSDP run starts from shares of 51 and 13 tokens,
    so rows move). The step's own logprobs come back to the rows the rank passed in."""
    run = runs[key]
    budget = int(key[1][1:])
    forwards = run["forwards"]
    assert all(shape[0] == 1 and shape[1] <= budget for f in forwards for shape in f)
    assert len({len(f) for f in forwards}) == 1
    loads = [sum(shape[1] for shape in f) for f in forwards]
    data_ranks = run["share"][1]
    assert sum(loads) == 64 * (len(forwards) // data_ranks)  # TP ranks run the same rows
    assert max(loads) == min(loads) == 64 // data_ranks
    # Under TP the head projects onto this rank's half of the vocabulary, never gathered.
    vocab = json.loads((TINY / "config.json").read_text())["vocab_size"]
    tp = "tp2" in key
    assert (run["head_parallel"], run["head_rows"]) == (tp, vocab // 2 if tp else vocab)
    batch = fixed_batch()
    rows = run["rows"]
    share_BT = run["logprobs_BT"][rows] * batch.loss_mask_BT[rows]
    torch.testing.assert_close(run["step_logprobs_BT"], share_BT, rtol=1e-6, atol=1e-6)


def test_the_vocabulary_parallel_head_equals_the_whole_head(runs):
    """Trainer TP: each rank projects onto its rows of the vocabulary only (never a [C, V]
    block, never the gathered weight), and the logprobs, entropies and both gradients equal
    the whole head's (tests/dist/policy_trainer_run.py: 2 ranks, an uneven 26/25 split, 5
    chunks, temperature 0.7)."""
    result = runs["head"]
    whole, parallel = result["whole"], result["parallel"]
    assert (whole["widest_logits"], parallel["widest_logits"]) == (51, 26)
    for name in ("logprobs", "entropy"):
        torch.testing.assert_close(parallel[name], whole[name], rtol=1e-6, atol=1e-6)
    # Gradients are sums over the vocabulary split across ranks: fp32 rounding of O(1) terms.
    for name in ("grad_hidden", "grad_weight"):
        torch.testing.assert_close(parallel[name], whole[name], rtol=1e-5, atol=1e-5)
    assert whole["logprobs"].shape == (37,) and (whole["logprobs"] < 0).all()
    assert whole["grad_weight"].abs().sum() > 0


# The step's reads by the project's code, outside the host planners (which read the host loss
# mask: tests/unit/test_model.py) and the library's (the CPU for-loop AdamW's step counters).
FIGURES = [("cpu", "policy_trainer.optimizer_step"), ("tolist", "policy_trainer.optimizer_step")]
TOTALS = [("tolist", "policy_trainer.optimizer_step")]  # of the all-reduced host totals


@pytest.mark.parametrize(
    "key, dealt",
    [
        ((2, "b16"), True),
        ((2, "b24", "full", "tp2"), False),
        ((2, 4), False),
        (("moe", 2, "b24", "ep2"), True),
    ],
)
def test_a_2_rank_step_reads_the_device_once_and_dealt_rows_come_back_before_the_optimizer(
    runs, key, dealt
):
    """On 2 ranks, FSDP packed with rows dealt between the ranks (uneven shares, 6 and 2), TP
    packed, FSDP padded in 4 micro-batches, and a MoE model with expert parallelism, packed and
    dealt: every rank's step reads the device once for its figures; where rows moved, their
    pre-update logprobs come back with one more `.cpu()`, right after the figures' read (the
    queue already drained), before the optimizer's kernels are queued and the host totals
    read. (What the libraries read: the next test.)"""
    for rank, calls in enumerate(runs[key]["host_reads"]):
        ours = [
            call
            for call in calls
            if call[1] not in HOST_PLANNERS and not call[1].startswith("library")
        ]
        returned = [("cpu", "packing.back")] if dealt else []
        assert ours == FIGURES + returned + TOTALS, (rank, ours)


# The libraries' reads in a step, by the library function that made them. Host tensors (no
# wait on a GPU): AdamW's step counters (for-loop AdamW), the gloo object gathers that deal
# rows, the test's own loss reading the host loss mask.
HOST_LIBRARY_READS = {
    "optimizer._get_value",
    "distributed_c10d.all_gather_object",
    "distributed_c10d._tensor_to_object",
    "batches.pg_loss",
}


@pytest.mark.parametrize("key", [(2, "b16"), ("moe", 2, "b24", "ep2")])
def test_what_the_libraries_read_in_a_step_is_named_and_the_expert_dispatchs_wait_counted(
    runs, key
):
    """Every read a library makes in a 2-rank step, named: besides host tensors, only
    torchtitan's expert-parallel dispatch reads the device, and it does per MoE layer per
    forward: the all-to-all's split sizes (`_sync_token_count_exchange`: a `.to("cpu")` then 2
    `.tolist()`, one wait on a GPU; docs/performance.md names it), and `_permute`'s
    `repeat_interleave`, counted but sized by those host splits (`output_size`: no wait). A
    dense step's libraries read only host tensors."""
    result = runs[key]
    moe_layers = 2 if key[0] == "moe" else 0  # the tiny Qwen3-MoE: every layer of its 2
    for rank, calls in enumerate(result["library_reads"]):
        forwards = len(result["forwards"][rank])
        device = collections.Counter(
            (call, library) for call, library, _ in calls if library not in HOST_LIBRARY_READS
        )
        expected = {
            ("tolist", "token_dispatcher._sync_token_count_exchange"): 2 * moe_layers * forwards,
            ("repeat_interleave.Tensor", "token_dispatcher._permute"): moe_layers * forwards,
        }
        assert device == {k: n for k, n in expected.items() if n}, (rank, device)
        # The census sees the host reads too: AdamW reads its step counters in every step.
        assert ("_local_scalar_dense.default", "optimizer._get_value") in {
            (call, library) for call, library, _ in calls
        }
