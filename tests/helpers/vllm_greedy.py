"""Greedy-generate with the real vLLM engine from an HF checkpoint; print JSON on the last line.

    .venv/bin/python tests/helpers/vllm_greedy.py assets/tiny_qwen3 "echo 123:" 8
    .venv/bin/python tests/helpers/vllm_greedy.py CKPT PROMPT N CKPT2 PROMPT2 N2 ...
        (several checkpoints, one engine after another: a JSON list, one entry each)

Runs in its own process: vLLM's CPU worker binds threads, which must not leak into pytest.
A Qwen3.5 checkpoint runs in bf16 and needs tests/helpers/stand_ins on PYTHONPATH.
"""

import gc
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# DeepSeek-V3 (and Kimi) without MLA: K/V decompressed per head. vLLM's CPU MLA kernel reads only
# a 576-wide latent (DeepSeek-V3's 512 + 64), not the tiny checkpoints' 96.
os.environ.setdefault("VLLM_MLA_DISABLE", "1")


def greedy(path: str, prompt: str, max_tokens: int) -> dict:
    from vllm import LLM, SamplingParams

    # Qwen3.5 (its config names Gated DeltaNet sizes) in bf16: vLLM's CPU kernels for those
    # layers take bf16 only. Its vLLM module imports torchvision: run this script with
    # tests/helpers/stand_ins on PYTHONPATH.
    config = json.loads((Path(path) / "config.json").read_text())
    dtype = "bfloat16" if "linear_num_value_heads" in config else "float32"
    llm = LLM(model=path, dtype=dtype, max_model_len=128, enforce_eager=True, seed=0)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0, ignore_eos=True)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    logprobs = [step[tok].logprob for step, tok in zip(out.logprobs, out.token_ids, strict=True)]
    del llm
    gc.collect()
    return {"token_ids": list(out.token_ids), "logprobs": logprobs}


if __name__ == "__main__":
    args = sys.argv[1:]
    runs = [greedy(p, prompt, int(n)) for p, prompt, n in zip(*[iter(args)] * 3, strict=True)]
    print(json.dumps(runs[0] if len(runs) == 1 else runs))
