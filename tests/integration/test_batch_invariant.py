"""Batch-invariant mode for real: the vLLM engine and the FSDP trainer on 2 ranks, bitwise.
The kernels themselves: tests/unit/test_batch_invariant.py.

    .venv/bin/python -m pytest tests/integration/test_batch_invariant.py
"""

import json
import shutil
from pathlib import Path

import pytest
from helpers import runs
from helpers.launch import DEBUG_TOML, metric_rows, run_dist, run_train

# Prompts up to 206 tokens: longer than vLLM's 128-token CPU KV block.
LONG_PROMPTS = ("--generator.max_model_len", "320", "--training.max_prompt_len", "256")
STEPS = ("--training.steps", "3", "--training.lr", "1e-2")
BF16 = ("--model.dtype", "bfloat16", "--generator.dtype", "bfloat16")
# The real pretrained SmolLM2-135M-Instruct (setup builds it), its shape from config.json, on a
# small step: 4 prompts x 4 samples of 8 tokens, one RL step.
SMOLLM2 = (
    *("--model.name", "llama3", "--model.flavor", "auto"),
    *("--model.hf_checkpoint", "assets/smollm2_135m_instruct", "--training.lr", "1e-5"),
    *("--training.steps", "1", "--training.prompts_per_step", "4"),
    *("--generator.sampling.n", "4", "--generator.sampling.max_tokens", "8"),
)


def probe(out: Path, *named_flags: tuple[str, tuple[str, ...]]) -> dict[str, dict]:
    """tests/dist/batch_invariant_run.py on 2 ranks, each (name, flags) run after the other in
    the same world: RL steps (FSDP=2, weight sync after each), then mixed-length prompts, one
    prompt alone and among 16 sequences: {name: its figures}; each run's dump folder is
    out/name."""
    args = []
    for name, flags in named_flags:
        args += ["--then"] if args else []
        args += [name, "--job.config_file", DEBUG_TOML, *LONG_PROMPTS, *flags]
        args += ["--job.dump_folder", str(out / name)]
    # Eight runs in one world: past 600 s on an AVX2 machine (no AVX-512 GEMMs).
    run_dist("batch_invariant_run.py", str(out / "result.json"), *args, nproc=2, timeout_s=1800)
    results = json.loads((out / "result.json").read_text())
    assert list(results) == [name for name, _ in named_flags]
    assert all(result["longest_prompt_tokens"] > 128 for result in results.values())
    return results


@pytest.fixture(scope="module")
def demo_world(tmp_path_factory) -> tuple[Path, dict[str, dict]]:
    """One world: the dense tiny Qwen3 with the mode off, in float32 and in bf16, and the
    pretrained SmolLM2 in float32, then (the mode stays on in a process once a run turns it
    on) the echo demo, SmolLM2, Muse Glimmer and Qwen3.5 with it on, every engine compiled
    (the default). (its folder, {run: figures})."""
    out = tmp_path_factory.mktemp("demo_world")
    vision = (*STEPS, *runs.VISION_MODEL, *runs.vision_task(out / "visual"))
    results = probe(
        out,
        *(
            (dtype, (*STEPS, "--model.dtype", dtype, "--generator.dtype", dtype))
            for dtype in ("float32", "bfloat16")
        ),
        ("smollm2", SMOLLM2),
        ("demo", ("--batch_invariant", "true")),
        ("smollm2_invariant", (*SMOLLM2, "--batch_invariant", "true")),
        ("muse_glimmer", (*STEPS, *runs.MUSE_GLIMMER_MODEL, *BF16, "--batch_invariant", "true")),
        ("vision", (*vision, *BF16, "--batch_invariant", "true")),
        ("qwen3_5", (*STEPS, *runs.QWEN3_5_MODEL, *BF16, "--batch_invariant", "true")),
    )
    return out, results


def test_images_are_bitwise_in_bf16_on_two_ranks(demo_world):
    """Muse Glimmer with its vision tower on the vision demo's prompts (a question and an image
    of 1 to 9 tokens, 32 prompts of mixed image sizes per step), the tower trained and synced:
    under batch-invariant mode in bf16 every step's generator and trainer logprobs are equal
    (each image encoded alone on both sides, the encoder's kernels the mode's), as are the
    text probes'. The engine compiled once, the encoder outside the graph. (fp32 with the mode
    off, within 1e-4: tests/integration/test_vision.py.)"""
    tmp_path, results = demo_world
    result = results["vision"]
    assert diffs(result) == [0.0] * 6, result
    assert result["alone_equals_among_16"]
    assert_compiled_once_without_host_reads("vision", result)
    rows = metric_rows(tmp_path / "vision")
    assert len(rows) == 3 and all(row["grad_norm"] > 0 for row in rows), rows  # it trains


def test_demo_learns_with_every_step_bitwise_on_policy_and_any_batch_after(demo_world):
    """The echo demo (100 steps) in batch-invariant mode: every step's generator and trainer
    logprobs are equal, it learns, and on the trained weights every batch composition gives
    the trainer's logprobs exactly. Then, in the same world, Muse Glimmer's text tower in bf16
    (3 steps and the probes): its prompts of up to 206 tokens cross the 16-token window of its
    sliding layers, and both sides soft-cap the head's logits with one routine. Then Qwen3.5's
    dense hybrid in bf16: both sides run the Gated DeltaNet recurrence token by token (the
    generator from its state slots: prefills, then decodes of varying batch), its gates through
    `ops.pointwise`."""
    tmp_path, results = demo_world
    for name in ("demo", "muse_glimmer", "qwen3_5"):
        assert_compiled_once_without_host_reads(name, results[name])
    for name in ("muse_glimmer", "qwen3_5"):
        assert diffs(results[name]) == [0.0] * 6, (name, results[name])
        assert results[name]["alone_equals_among_16"], name
        assert len(metric_rows(tmp_path / name)) == 3
    result = results["demo"]
    rows = metric_rows(tmp_path / "demo")
    assert len(rows) == 100 == len(result["steps"])
    assert all(row["batch_invariant"] == 1.0 for row in rows)
    assert [row["logprob_diff/max"] for row in rows] == [0.0] * 100
    assert [step["logprob_diff/max"] for step in result["steps"]] == [0.0] * 100
    assert (
        {row["offpolicy/ratio_max"] for row in rows}
        == {row["offpolicy/ratio_min"] for row in rows}
        == {1.0}
    )
    # Synchronous and bitwise: nothing is off-policy, so the KL(behaviour || old) is 0.
    assert {row["offpolicy/kl"] for row in rows} == {0.0}
    first, last = rows[:5], rows[-10:]
    assert sum(r["reward/mean"] for r in first) / 5 < 0.2
    assert sum(r["reward/mean"] for r in last) / 10 > 0.9
    assert [result["mixed_lengths"], result["alone"], result["among_16"]] == [0.0] * 3, result
    assert result["alone_equals_among_16"]


def test_the_pretrained_smollm2_is_within_fp32s_bound_and_bitwise_under_the_mode(demo_world):
    """SmolLM2-135M-Instruct (30 layers, 9 heads over 3 KV heads, a 49,152-token vocabulary,
    tied; model.flavor = "auto") on 2 ranks, FSDP 2, a generator replica per rank: an RL step
    and the probes. With the mode off in fp32, generator and trainer logprobs differ within
    fp32's bound (not bitwise: vLLM's CPU kernels are not the trainer's; measured 4.3e-5,
    probes 3.6e-5); with it on, every difference is exactly 0.0."""
    tmp_path, results = demo_world
    off, on = diffs(results["smollm2"]), diffs(results["smollm2_invariant"])
    assert max(off) < 1e-3 and max(off) > 0.0, off
    assert on == [0.0] * 4, on
    assert results["smollm2_invariant"]["alone_equals_among_16"]
    for name in ("smollm2", "smollm2_invariant"):
        rows = metric_rows(tmp_path / name)
        assert len(rows) == 1 and rows[0]["grad_norm"] > 0, rows


def assert_compiled_once_without_host_reads(name: str, result: dict) -> None:
    """Issue 67: the run's engine (batch-invariant: the "eager" backend, this project's
    kernels) traced its decoder once, over the run's steps, weight syncs and probes, and no
    node of its graph reads the device on the host (helpers/compiled_graphs.py; the
    batch-invariant experts and pointwise ops are opaque)."""
    graphs = result["graphs"]
    assert result["engine_compiled"] and graphs["graphs"] == 1, (name, graphs)
    assert graphs["host_reads"] == [], (name, graphs["host_reads"])


def diffs(result: dict) -> list[float]:
    """A run's logprob_diff/max at each step, then its three probes'."""
    steps = [step["logprob_diff/max"] for step in result["steps"]]
    return steps + [result["mixed_lengths"], result["alone"], result["among_16"]]


def test_every_mixture_of_experts_family_is_bitwise_in_bf16_under_torchrun(tmp_path):
    """3 RL steps that move the weights, then the probes, in bf16 with the mode on, every
    difference exactly 0.0 (float32 with the mode on is the demo above), for each
    mixture-of-experts family with its experts split over the ranks (EP = 2), one run after
    the other in one world:
    - the tiny Qwen3-MoE: routing is a top-k of batch-invariant gate logits, so both sides
      pick the same experts, whose batch-invariant GEMMs then give the same bits however many
      tokens share an expert;
    - the tiny gpt-oss, whose prompts of up to 200 tokens cross its 16-token sliding window,
      with its attention sinks: both sides attend with `ops.attention` and rescale by its
      chunked logsumexp;
    - DeepSeek-V3 with group-limited routing (tiny_grouped) and Kimi K2's text tower: latent
      attention, whose values are narrower than its keys (the generator pads them in vLLM's
      cache and reads them back unpadded), sigmoid routing with the correction bias, shared
      experts. Kimi's run trains the bias (training.expert_bias_update_rate): each step's
      sync carries the moved bias, so the generator routes as the trainer does;
    - Qwen3.5-MoE: Gated DeltaNet layers (above), a sigmoid-gated shared expert (its gate
      through `ops.pointwise`: one value a token is narrower than ATen's vector loop)."""
    models = {
        "moe": runs.MOE_MODEL,
        "gpt_oss": runs.GPT_OSS_MODEL,
        "deepseek_v3": runs.DEEPSEEK_V3_MODEL,
        "kimi_k2_7": (*runs.KIMI_MODEL, "--training.expert_bias_update_rate", "1e-2"),
        "qwen3_5_moe": runs.QWEN3_5_MOE_MODEL,
    }
    results = probe(
        tmp_path,
        *(
            (name, (*STEPS, *flags, *BF16, "--batch_invariant", "true"))
            for name, flags in models.items()
        ),
    )
    for name, result in results.items():
        assert_compiled_once_without_host_reads(name, result)
        assert diffs(result) == [0.0] * 6, (name, result)
        assert [step["offpolicy/ratio_max"] for step in result["steps"]] == [1.0] * 3, name
        assert result["alone_equals_among_16"], name
    # Five models, not one five times: each run's last step has its own entropy.
    assert len({metric_rows(tmp_path / name)[-1]["entropy"] for name in results}) == 5


def test_every_tensor_parallel_layout_of_two_ranks_is_bitwise(tmp_path):
    """Each layout of 2 ranks with a TP side, 3 RL steps that move the weights, then the
    probes, every difference exactly 0.0, in fp32 and in bf16:
    - trainer FSDP 2, one generator over both ranks at TP 2 (each rank half of every attention
      head group and MLP unit), on the tiny Qwen3 and Llama 3 (whose random checkpoint earns
      no reward: its steps sync unchanged weights);
    - trainer TP 2 (its row-parallel layers DTensors split by input columns, its head over the
      whole vocabulary), a generator replica per rank (TP 1);
    - trainer TP 2 and generator TP 2;
    - mixtures of experts, trained with EP 2 (experts whole on each rank), generated at TP 2
      with every expert's hidden units split over the ranks: the tiny Qwen3-MoE (fp32),
      gpt-oss (bf16: its output bias added once, after the sum) and DeepSeek-V3 (bf16: latent
      attention, shared experts, group-limited routing);
    - Qwen3.5, dense and MoE (fp32), generated at TP 2: each rank runs half of every Gated
      DeltaNet layer's heads, its output projection row-parallel. Its gate projections are 4
      outputs wide, 2 a rank: `ops.linear` pads outputs to COL_TILE so that a narrow
      column-parallel shard rounds as the whole layer (without it: 9.5e-7 to 1.4e-6 a step).
    Each row-parallel layer (attention output, MLP down projection, each expert's down
    projection) reduces in 2 canonical slices on every side: one device sums both
    (`ops.partial_products`), two ranks each sum theirs and add the two in fp32 (for experts,
    every routed row before the dispatcher weighs and adds a token's experts). The trainer TP 2
    step takes FSDP's step (its gradient norms equal within fp32 rounding: the same samples, the
    backward's sums in another order). The engine compiled once, without host reads. Planted:
    the first layout with the plain reduction (each rank's GEMM over its half, summed over the
    ranks) is not bitwise (planted on a TP trainer's side, with a replica per rank, it differs
    too: 4.8e-7 to 7.2e-7 a step; in the experts' down projection alone, 4.8e-7 to 9.5e-7 on
    Qwen3-MoE and 5e-3 to 2.7e-2 on gpt-oss in bf16; measured by hand, not rerun here;
    tests/unit/test_batch_invariant.py plants the experts' on one layer);
    - and with the generator's experts whole, half on each rank (expert_parallel), routing 4
      experts a token (the tiny Qwen3-MoE in fp32 and gpt-oss in bf16, their config.json's
      top-k raised from 2, where any order adds alike): each rank puts its experts' rows in
      place, the rows' sum over the ranks adds zeros, and every rank adds a token's experts in
      the one-device order (`RankExperts.sum_rows`). Planted: each rank adds its own experts'
      share, then the shares are summed (the plain order, `--plant_ranks_sum`): 4.8e-7 a step
      (measured by hand), asserted not bitwise here;
    - Muse Glimmer with its vision tower trained, on the vision demo's image prompts, in bf16
      at generator TP 2: the tower's row-parallel layers (attention output, MLP fc2) reduce
      canonically like the decoder's (planted in the tower alone, plain: 0.49, 0.56, 0.06 a
      step, measured by hand)."""
    tp2 = ("--batch_invariant", "true", "--generator.parallelism.tensor_parallel_degree", "2")
    ep = ("--generator.parallelism.expert_parallel", "true")
    moe4 = routing_four(runs.MOE_MODEL, tmp_path / "moe_top4")
    gpt_oss4 = routing_four(runs.GPT_OSS_MODEL, tmp_path / "gpt_oss_top4")
    vision = (*STEPS, *runs.VISION_MODEL, *runs.vision_task(tmp_path / "visual"))
    trainer_tp2 = ("--batch_invariant", "true", "--parallelism.tp", "2")
    warn = ("--batch_invariant_on_mismatch", "warn")  # the planted runs run on to their probes
    llama = ("--model.name", "llama3", "--model.hf_checkpoint", "assets/tiny_llama3")
    both = (*trainer_tp2, *tp2[2:])
    results = probe(
        tmp_path,
        ("fp32", (*STEPS, *tp2)),
        ("bf16", (*STEPS, *tp2, *BF16)),
        ("llama3_bf16", (*STEPS, *tp2, *BF16, *llama)),
        ("trainer_tp2", (*STEPS, *trainer_tp2)),
        ("trainer_tp2_bf16", (*STEPS, *trainer_tp2, *BF16)),
        ("both_tp2", (*STEPS, *both)),
        ("both_tp2_bf16", (*STEPS, *both, *BF16)),
        ("moe_tp2", (*STEPS, *tp2, *runs.MOE_MODEL)),
        ("gpt_oss_tp2_bf16", (*STEPS, *tp2, *BF16, *runs.GPT_OSS_MODEL)),
        ("deepseek_v3_tp2_bf16", (*STEPS, *tp2, *BF16, *runs.DEEPSEEK_V3_MODEL)),
        ("qwen3_5_tp2", (*STEPS, *tp2, *runs.QWEN3_5_MODEL)),
        ("qwen3_5_moe_tp2", (*STEPS, *tp2, *runs.QWEN3_5_MOE_MODEL)),
        ("moe_top4_ep_tp2", (*STEPS, *tp2, *ep, *moe4)),
        ("gpt_oss_top4_ep_tp2_bf16", (*STEPS, *tp2, *ep, *BF16, *gpt_oss4)),
        ("vision_tp2_bf16", (*vision, *tp2, *BF16)),
        ("planted", (*STEPS, *tp2, *warn, "--plant_plain_reduction")),
        ("planted_ranks_sum", (*STEPS, *tp2, *ep, *moe4, *warn, "--plant_ranks_sum")),
    )
    exact = [name for name in results if not name.startswith("planted")]
    for name in exact:
        result = results[name]
        assert_compiled_once_without_host_reads(name, result)
        assert diffs(result) == [0.0] * 6, (name, result)
        assert result["alone_equals_among_16"], name
        rows = metric_rows(tmp_path / name)
        assert len(rows) == 3, rows
        if name != "llama3_bf16":  # its random checkpoint answers ':' (p 0.995): no reward
            assert all(row["grad_norm"] > 0 for row in rows), rows
    # Step 1 of trainer TP 2 and of FSDP, before any update: the same samples (one TP 2
    # generator), the same forward bits, the same gradient up to the backward's rounding.
    ours, theirs = metric_rows(tmp_path / "both_tp2")[0], metric_rows(tmp_path / "fp32")[0]
    assert ours["reward/mean"] == theirs["reward/mean"], (ours, theirs)
    assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5), (ours, theirs)
    assert max(diffs(results["planted"])) > 0.0, results["planted"]
    assert max(diffs(results["planted_ranks_sum"])) > 0.0, results["planted_ranks_sum"]


def routing_four(model_flags: tuple[str, ...], folder: Path) -> tuple[str, ...]:
    """`model_flags` (a tiny MoE checkpoint's) with a copy of its checkpoint in `folder` that
    routes 4 experts a token (its config.json's top-k; the same weights), read by
    model.flavor = "auto"."""
    flags = dict(zip(model_flags[::2], model_flags[1::2], strict=True))
    shutil.copytree(flags["--model.hf_checkpoint"], folder)
    config = json.loads((folder / "config.json").read_text())
    for key in ("num_experts_per_tok", "experts_per_token"):
        if key in config:
            config[key] = 4
    (folder / "config.json").write_text(json.dumps(config))
    flags |= {"--model.flavor": "auto", "--model.hf_checkpoint": str(folder)}
    return tuple(arg for pair in flags.items() for arg in pair)


def test_a_tensor_parallel_trainer_and_a_tensor_parallel_generator_on_their_own_ranks(tmp_path):
    """The disaggregated placement on 4 ranks: trainer TP 2 on ranks 0-1, one generator at
    TP 2 on ranks 2-3 (its engine in its own processes, on local shards), 3 RL steps that
    move the weights, each step's logprob difference 0.0 (fp32). The colocated layouts and the
    probes: the test above."""
    result = run_train(
        *("--job.config_file", DEBUG_TOML, *STEPS, "--batch_invariant", "true"),
        *("--parallelism.tp", "2", "--generator.placement", "disaggregated"),
        *("--generator.num_ranks", "2", "--generator.parallelism.tensor_parallel_degree", "2"),
        *("--job.dump_folder", str(tmp_path)),
        nproc=4,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metric_rows(tmp_path)
    assert [row["logprob_diff/max"] for row in rows] == [0.0] * 3, rows
    assert all(row["grad_norm"] > 0 for row in rows), rows


def test_without_the_mode_the_same_probes_differ_in_fp32_and_bf16(demo_world):
    """The same measurement with the mode off is not 0.0, in float32 and in bf16 (so the
    tests above can fail), on the dense tiny Qwen3: the demo world's first two runs."""
    _, results = demo_world
    for dtype in ("float32", "bfloat16"):
        assert max(diffs(results[dtype])) > 0.0, (dtype, results[dtype])
