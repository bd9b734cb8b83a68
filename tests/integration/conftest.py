"""The runs that integration tests share, each started once per session: the RL reference
run (checkpoints, export, metrics files, console), the LoRA run, the MoE run and the SFT run.
A test that needs one names its fixture; tests/helpers/runs.py holds their flags."""

from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch
from helpers import runs
from helpers.launch import TESTS, launcher, processes_below, run, run_dist, run_train


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory) -> SimpleNamespace:
    """The echo demo (runs.REFERENCE + W&B) under torchrun with 2 ranks through the train
    entry point, then its generator's greedy tokens: `folder` (the dump folder), `result`
    (the launcher's exit code, stdout and stderr)."""
    folder = tmp_path_factory.mktemp("reference")
    command = [
        *launcher(2),
        str(TESTS / "dist" / "reference_run.py"),
        runs.GREEDY_PROMPT,
        str(runs.GREEDY_TOKENS),
        *runs.REFERENCE,
        *runs.WANDB,
        *("--job.dump_folder", str(folder)),
    ]
    result = run(command, env=runs.WANDB_ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    # wandb's service process (wandb-core) outlives the run by a moment, and this session
    # adopts it (tests/conftest.py: a subreaper): let it exit before the no-process-left check.
    psutil.wait_procs(processes_below(), timeout=60)
    return SimpleNamespace(folder=folder, result=result)


@pytest.fixture(scope="session")
def lora_run(tmp_path_factory) -> Path:
    """runs.LORA, uninterrupted, under torchrun with 2 ranks: its dump folder."""
    folder = tmp_path_factory.mktemp("lora_e2e")
    result = run_train(*runs.LORA, "--job.dump_folder", str(folder), nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    return folder


@pytest.fixture(scope="session")
def moe_run(tmp_path_factory) -> Path:
    """runs.MOE (tiny_moe, EP = 2) under torchrun with 2 ranks through the train entry point,
    then tests/dist/moe_run.py's checks on the trained weights: its dump folder (moe.json)."""
    folder = tmp_path_factory.mktemp("moe")
    run_dist(
        "moe_run.py",
        runs.GREEDY_PROMPT,
        str(runs.GREEDY_TOKENS),
        *runs.MOE,
        *("--job.dump_folder", str(folder)),
        nproc=2,
    )
    return folder


@pytest.fixture(scope="session")
def sft_run(tmp_path_factory) -> Path:
    """runs.SFT, uninterrupted, under torchrun with 2 ranks, with its export: its dump folder
    (console.txt holds its console)."""
    folder = tmp_path_factory.mktemp("sft")
    result = run_train(
        *runs.SFT, "--job.dump_folder", str(folder), nproc=2, module="torchtitan_rl.sft"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (folder / "console.txt").write_text(result.stdout)
    return folder


def engine_world(tmp_path_factory, nproc: int, checks: dict[str, str]) -> dict[str, list[dict]]:
    """tests/dist/engine_run.py with `nproc` ranks (0: a plain process), one engine per rank for
    each model of `checks` ({model: "generator" and/or "weight_sync"}), one model after the
    other: {model: what each rank measured}."""
    out = tmp_path_factory.mktemp(f"engine_w{nproc}")
    pairs = [part for model, which in checks.items() for part in (model, which)]
    run_dist("engine_run.py", str(out), *pairs, nproc=nproc)
    return {
        model: [
            torch.load(out / f"{model}.rank{r}.pt", weights_only=False)
            for r in range(max(nproc, 1))
        ]
        for model in checks
    }


@pytest.fixture(scope="session")
def engines_two_ranks(tmp_path_factory) -> dict[str, list[dict]]:
    """The tiny Qwen3 on 2 torchrun ranks, the generator's and the weight sync's checks: first
    on one engine per rank ("qwen3"), then on one engine over both ranks, tensor parallel
    ("qwen3@tp2", both ranks with rank 0's prompts and seeds; the sampling checks, not those
    of stop ids and bad prompts, which do not depend on the layout); then Muse Glimmer's engine
    over both ranks (its sampling and weight sync checks); then Qwen3.5's, tensor parallel
    (fp32), and its MoE's, expert parallel (bf16, on vLLM's kernels); then the other MoE
    families over both ranks, compiled on local shards: Qwen3-MoE's experts whole per rank
    (expert parallel) on plain GEMMs, gpt-oss's experts' hidden units per rank (the plan's
    default) on vLLM's kernels, DeepSeek-V3's on plain GEMMs; then Muse Glimmer's
    vision-language flavor over both ranks, its vision encoder split too (prompts with
    images, its tower synced)."""
    checks = {
        "qwen3": "generator,weight_sync",
        "qwen3@tp2": "sampling,weight_sync,lora_sync",
        "muse_glimmer@tp2": "sampling,weight_sync",
        "qwen3_5@tp2": "sampling,weight_sync",
        "qwen3_5_moe@ep2+bf16": "sampling",
        "moe@ep2+plain": "sampling,weight_sync",
        "gpt_oss@tp2": "sampling,weight_sync",
        "deepseek_v3@tp2+plain": "sampling",
        "muse_glimmer_vl@tp2": "images",
    }
    return engine_world(tmp_path_factory, 2, checks)


@pytest.fixture(scope="session")
def engine_two_ranks(engines_two_ranks) -> list[dict]:
    """One engine per rank: [{"generator": ..., "weight_sync": ...}] * 2."""
    return engines_two_ranks["qwen3"]


@pytest.fixture(scope="session")
def engines_plain(tmp_path_factory) -> dict[str, list[dict]]:
    """One plain process (a world of one), one engine after another: the tiny Qwen3's weight
    sync checks, the tiny Llama3's generator checks, the tiny gpt-oss's, DeepSeek-V3's, Muse
    Glimmer's and Qwen3.5's generator and weight sync checks, and for each of them and the tiny
    Qwen3-MoE the compiled engine against an eager one; then Qwen3.5 in bf16, on vLLM's
    kernels; then Muse Glimmer's vision-language flavor with images (one process start for
    the nine)."""
    checks = {
        "qwen3": "weight_sync,compiled",
        "llama3": "generator,compiled",
        "gpt_oss": "generator,weight_sync,compiled",
        "moe": "sampling,compiled",
        "deepseek_v3": "generator,weight_sync,compiled",
        "muse_glimmer": "generator,weight_sync,compiled",
        "qwen3_5": "generator,weight_sync,compiled",
        "qwen3_5@bf16": "sampling",
        "muse_glimmer_vl": "images",
    }
    return engine_world(tmp_path_factory, 0, checks)


@pytest.fixture(scope="session")
def engine_plain(engines_plain) -> list[dict]:
    """The tiny Qwen3 in a plain process, the weight sync's checks."""
    return engines_plain["qwen3"]


@pytest.fixture(scope="session")
def engine_plain_llama3(engines_plain) -> list[dict]:
    """The tiny Llama3 in a plain process, the generator's checks."""
    return engines_plain["llama3"]


@pytest.fixture(scope="session")
def engine_plain_gpt_oss(engines_plain) -> list[dict]:
    """The tiny gpt-oss in a plain process, the generator's and the weight sync's checks."""
    return engines_plain["gpt_oss"]


@pytest.fixture(scope="session")
def stream_world(tmp_path_factory) -> dict:
    """tests/dist/stream_run.py: the engine as a request stream with weights in flight
    (test_continuous.py), then the agents' gateway on it (test_gateway.py)."""
    import torch

    out = tmp_path_factory.mktemp("stream") / "stream.pt"
    run_dist("stream_run.py", str(out), nproc=0)
    return torch.load(out, weights_only=False)
