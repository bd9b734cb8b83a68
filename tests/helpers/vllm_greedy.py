"""Greedy-generate with the real vLLM engine from an HF checkpoint; print JSON on the last line.

    .venv/bin/python tests/helpers/vllm_greedy.py assets/tiny_qwen3 "echo 123:" 8

Runs in its own process: vLLM's CPU worker binds threads, which must not leak into pytest.
"""

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

if __name__ == "__main__":
    from vllm import LLM, SamplingParams

    path, prompt, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
    llm = LLM(model=path, dtype="float32", max_model_len=128, enforce_eager=True, seed=0)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0, ignore_eos=True)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    logprobs = [step[tok].logprob for step, tok in zip(out.logprobs, out.token_ids, strict=True)]
    print(json.dumps({"token_ids": list(out.token_ids), "logprobs": logprobs}))
