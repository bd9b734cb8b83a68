"""The tiny HF checkpoint: the script makes the same bytes for the same seed, and vLLM's greedy
completion of it is torchtitan's argmax.

    .venv/bin/python -m pytest tests/integration/test_tiny_checkpoint.py
"""

import json
import subprocess
from pathlib import Path

import pytest
import torch
from helpers.launch import REPO, environment, launcher, run
from helpers.titan import torchtitan_logits, torchtitan_model

TINY = REPO / "assets" / "tiny_qwen3"
PROMPT = "echo 123: 123"


def make(*outs: tuple[Path, int]) -> None:
    """Run scripts/make_tiny_checkpoint.py for each (folder, seed), each its own process, all
    at once."""
    script = str(REPO / "scripts" / "make_tiny_checkpoint.py")
    processes = [
        subprocess.Popen(
            [*launcher(0), script, "--out", str(out), "--seed", str(seed)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=environment(),
        )
        for out, seed in outs
    ]
    for process in processes:
        _, stderr = process.communicate(timeout=300)
        assert process.returncode == 0, stderr.decode()[-3000:]


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path):
    make((tmp_path / "a", 0), (tmp_path / "b", 0), (tmp_path / "c", 1))
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert names == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "torchtitan.json",
    ]
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    a = (tmp_path / "a" / "model.safetensors").read_bytes()
    assert a != (tmp_path / "c" / "model.safetensors").read_bytes()
    assert (tmp_path / "a" / "model.safetensors").stat().st_size < 5 * 2**20


MAX_TOKENS = {"qwen3": 6, "gpt_oss": 30, "deepseek_v3": 30, "kimi_k2_7": 30}
# The real pretrained model setup builds (scripts/make_smollm2.py): a question in its chat
# template, with its default system prompt.
SMOLLM2 = REPO / "assets" / "smollm2_135m_instruct"
SMOLLM2_QUESTIONS = ("What is 17 + 25?", "Name the capital of France.", "Count from 3 to 9.")
SMOLLM2_TOKENS = 24


def smollm2_prompt(question: str) -> str:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2)
    messages = [{"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


QWEN3_5, QWEN3_5_TOKENS, QWEN3_5_PROMPT = ("tiny", "tiny_moe"), 20, " ".join([PROMPT] * 2)


@pytest.fixture(scope="module")
def native_greedy() -> dict[str, dict]:
    """vLLM's own model class greedy-decoding each tiny checkpoint, one engine after another in
    one process: {name: {"token_ids": ..., "logprobs": ...}}; Qwen3.5's ("tiny_qwen3_5",
    "tiny_moe_qwen3_5") in bf16. A stand-in torchvision (tests/helpers/stand_ins) is on that
    process's path: vLLM's qwen3_5 module imports vision code that imports torchvision, which
    has no CPU wheel for this torch; a text model never calls it."""
    runs = {name: (f"tiny_{name}", PROMPT, n) for name, n in MAX_TOKENS.items()}
    for flavor in QWEN3_5:
        runs[f"{flavor}_qwen3_5"] = (f"{flavor}_qwen3_5", QWEN3_5_PROMPT, QWEN3_5_TOKENS)
    runs["smollm2"] = (SMOLLM2.name, smollm2_prompt(SMOLLM2_QUESTIONS[0]), SMOLLM2_TOKENS)
    args = [
        str(part)
        for folder, prompt, n in runs.values()
        for part in (REPO / "assets" / folder, prompt, n)
    ]
    result = run(
        [*launcher(0), str(REPO / "tests" / "helpers" / "vllm_greedy.py"), *args],
        env={"PYTHONPATH": str(REPO / "tests" / "helpers" / "stand_ins")},
        timeout_s=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    outs = json.loads(result.stdout.strip().splitlines()[-1])
    return dict(zip(runs, outs, strict=True))


@pytest.mark.parametrize("name", list(MAX_TOKENS))
def test_vllm_loads_it_and_greedy_matches_torchtitan(name, native_greedy):
    """vLLM's own model class for the checkpoint (Qwen3ForCausalLM, GptOssForCausalLM: its
    sinks and sliding window in its CPU kernel, its YaRN RoPE; DeepseekV3ForCausalLM for
    DeepSeek-V3 and Kimi: latent attention without its MLA kernel, sigmoid routing with the
    correction bias, shared experts) reads what the adapter wrote. gpt-oss's, DeepSeek-V3's and
    Kimi's 43 tokens cross the 32-token original context of their YaRN RoPE (gpt-oss's
    16-token window too)."""
    from transformers import AutoTokenizer

    path = REPO / "assets" / f"tiny_{name}"
    out = native_greedy[name]
    assert len(out["token_ids"]) == MAX_TOKENS[name]

    # Replay vLLM's completion through torchtitan: each token must be the argmax, with the
    # logprob vLLM reported (fp32; generator and trainer differ by ~1e-6, see DESIGN.md).
    ids = AutoTokenizer.from_pretrained(path)(PROMPT)["input_ids"]
    logprobs_TV = torch.log_softmax(
        torchtitan_logits(str(path), ids + out["token_ids"], "tiny", name).float(), dim=-1
    )
    for i, token in enumerate(out["token_ids"]):
        row = logprobs_TV[len(ids) - 1 + i]
        assert int(row.argmax()) == token
        assert abs(float(row[token]) - out["logprobs"][i]) < 1e-4


@pytest.mark.parametrize("flavor", QWEN3_5)
def test_vllm_qwen3_5_reads_it_in_bf16_and_greedy_follows_torchtitan(flavor, native_greedy):
    """vLLM's own Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM, with its C++ CPU kernels for the
    Gated DeltaNet layers (bf16 only, head dims 64 or 128: the tiny's are 64), reads the
    checkpoint the adapter wrote and greedy-decodes 20 tokens. Replayed through torchtitan in
    fp32: each token's logprob within 0.03 of vLLM's bf16 one (measured: 0.011 dense, 0.013
    MoE), and each token torchtitan's argmax wherever its top two are more than 0.03 apart
    (bf16 can swap closer ones: the MoE's 4th token, 0.003 apart, measured). vLLM's process
    has a stand-in torchvision on its path (`native_greedy`)."""
    from transformers import AutoTokenizer

    path = REPO / "assets" / f"{flavor}_qwen3_5"
    out = native_greedy[f"{flavor}_qwen3_5"]
    assert len(out["token_ids"]) == QWEN3_5_TOKENS
    ids = AutoTokenizer.from_pretrained(path)(QWEN3_5_PROMPT)["input_ids"]
    logprobs_TV = torch.log_softmax(
        torchtitan_logits(str(path), ids + out["token_ids"], flavor, "qwen3_5").float(), dim=-1
    )
    rows = logprobs_TV[len(ids) - 1 : len(ids) - 1 + QWEN3_5_TOKENS]
    top2 = rows.topk(2, dim=-1).values
    for row, top, token, logprob in zip(rows, top2, out["token_ids"], out["logprobs"], strict=True):
        assert abs(float(row[token]) - logprob) < 0.03
        if top[0] - top[1] > 0.03:
            assert int(row.argmax()) == token


def test_vllm_native_llama_on_the_pretrained_smollm2_follows_torchtitan(native_greedy):
    """The real pretrained model (SmolLM2-135M-Instruct, 4-bit-dequantized: 30 layers, 9 heads
    over 3 KV heads, a 49,152-token BPE, tied) through vLLM's own LlamaForCausalLM, compiled, in
    fp32, and through torchtitan's llama3 built from its config.json (model.flavor = "auto"):
    each of vLLM's 24 greedy tokens is torchtitan's argmax wherever its top two are more than
    1e-3 apart, with the logprob vLLM reported within 1e-4."""
    from transformers import AutoTokenizer

    out = native_greedy["smollm2"]
    assert len(out["token_ids"]) == SMOLLM2_TOKENS
    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2)
    ids = tokenizer(smollm2_prompt(SMOLLM2_QUESTIONS[0]))["input_ids"]
    flavor = f"auto:{SMOLLM2}"
    logprobs_TV = torch.log_softmax(
        torchtitan_logits(str(SMOLLM2), ids + out["token_ids"], flavor, "llama3"), dim=-1
    )
    rows = logprobs_TV[len(ids) - 1 : len(ids) - 1 + SMOLLM2_TOKENS]
    top2 = rows.topk(2, dim=-1).values
    for row, top, token, logprob in zip(rows, top2, out["token_ids"], out["logprobs"], strict=True):
        assert abs(float(row[token]) - logprob) < 1e-4
        if top[0] - top[1] > 1e-3:
            assert int(row.argmax()) == token


def test_transformers_logits_of_the_pretrained_smollm2_are_torchtitans():
    """transformers' LlamaForCausalLM on the folder (eager attention, fp32) and torchtitan's
    llama3 read from its config.json give the same logits on three chat prompts, within
    fp32's bound for 30 layers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2)
    hf = AutoModelForCausalLM.from_pretrained(SMOLLM2, attn_implementation="eager")
    model = torchtitan_model(str(SMOLLM2), f"auto:{SMOLLM2}", "llama3")
    for question in SMOLLM2_QUESTIONS:
        ids = tokenizer(smollm2_prompt(question))["input_ids"]
        with torch.no_grad():
            expected = hf(torch.tensor([ids])).logits[0]
            logits = model(torch.tensor([ids]), positions=torch.arange(len(ids))[None])[0]
        assert logits.shape == expected.shape == (len(ids), 49152)
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
