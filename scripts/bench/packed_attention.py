"""Benchmark the CPU kernels for document-causal attention over one packed row.

    .venv/bin/python scripts/bench/packed_attention.py [--tokens 8192] [--threads 2]

Packs sequences of the trainer bench's long-tailed mix (scripts/bench/trainer.py) into one row
of at most `--tokens` tokens and times, at the debugmodel attention shape (16 query heads,
8 kv heads, head dim 128), forward + backward of: causal SDPA per document (the CPU choice,
`platform.packed_attention_kernel`), one SDPA over the row with a block-diagonal causal mask,
and, forward only (it has no CPU backward), FlexAttention with a document BlockMask. Prints one
JSON line: median milliseconds of each and `masked_over_per_document`.
"""

import argparse
import json

import torch
from children import median_ms
from trainer import longtail_mix

from torchtitan_rl.trainer import attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    lengths, total = [], 0
    for prompt, completion in longtail_mix(64, 4096, seed=0):
        if total + prompt + completion <= args.tokens:
            lengths.append(prompt + completion)
            total += prompt + completion
    docs = attention.documents(lengths, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    N, K, H = 16, 8, 128
    q = torch.randn(1, total, N, H, generator=g, requires_grad=True)
    k, v = (torch.randn(1, total, K, H, generator=g, requires_grad=True) for _ in range(2))

    def step(kernel):
        out = kernel(q, k, v, docs, enable_gqa=True)
        out.sum().backward()

    per_document = median_ms(lambda: step(attention.sdpa_per_document), args.repeats)
    masked = median_ms(lambda: step(attention.masked_sdpa), args.repeats)
    row = {
        "bench": "packed_attention",
        "tokens": total,
        "documents": len(lengths),
        "threads": args.threads,
        "per_document_ms": round(per_document, 2),
        "masked_ms": round(masked, 2),
        "masked_over_per_document": round(masked / per_document, 2),
    }
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        doc_L = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))

        def document_causal(b, h, q_idx, kv_idx):
            return (doc_L[q_idx] == doc_L[kv_idx]) & (q_idx >= kv_idx)

        mask = create_block_mask(document_causal, 1, None, total, total, device="cpu")
        qt, kt, vt = (x.detach().transpose(1, 2) for x in (q, k, v))
        with torch.no_grad():
            flex = median_ms(
                lambda: flex_attention(qt, kt, vt, block_mask=mask, enable_gqa=True), 3
            )
        with torch.no_grad():
            forward = median_ms(
                lambda: attention.sdpa_per_document(q, k, v, docs, enable_gqa=True), 3
            )
        row["flex_forward_ms"] = round(flex, 2)
        row["per_document_forward_ms"] = round(forward, 2)
    except Exception as e:  # noqa: BLE001 - report why FlexAttention did not run
        row["flex_forward_ms"] = f"did not run: {type(e).__name__}: {str(e)[:120]}"
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
