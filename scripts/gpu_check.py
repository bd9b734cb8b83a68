"""The CUDA-only parts of the trainer, checked with torch alone on a lent GPU; one JSON line.

    scripts/gpu_check.sh                 (a GPU machine with torch; no vLLM, no torchtitan needed)
    .venv/bin/python scripts/gpu_check.py --small      (CPU: the same code at small shapes)

docs/cuda_contracts.md says what each check stands for. Four checks, each its own JSON key,
each catching its own error so that one failure does not hide the others:
- "varlen": `packed_attention.varlen` (flash varlen_attn, bf16, causal per document) against
  `sdpa_per_document` on the same bf16 row and against an fp32 reference, forward and backward,
  on a long-tailed packed row at Qwen3-0.6B's attention shape; causality checked bitwise (a
  change to a later token of a document leaves its earlier outputs unchanged); the kernel's
  default window (full attention) shown to differ;
- "head": `logprobs.head_logprobs` (chunked LM head) against full logits at Qwen3-0.6B's head
  (151,936 x 1,024) and 16k tokens, forward and backward: peak device memory of each and the
  largest logprob difference;
- "batch_invariance": a row's GEMM and log_softmax bits at several batch sizes, plain and, where
  vLLM's CUDA build is installed, under its in-tree batch-invariant kernels (what
  `platform.enable_batch_invariance` installs), with the trainer's attention under the mode
  (batch_invariant/flash.py: vLLM's flash forward) against torch's varlen_attn, forward and
  backward, and a sequence alone against among others, bitwise;
- "process_groups": a `cpu:gloo,cuda:nccl` world (platform.init_distributed): a host tensor
  through gloo (platform.all_reduce_host), a device tensor through NCCL, a subgroup;
- "grouped_mm": `torch._grouped_mm` as models/moe.py's experts call it (rows grouped by
  expert, the weights [E, out, in] transposed), in fp32 and bf16, against a loop over the
  experts, at a gpt-oss-20b expert layer's shape (4 experts per rank under EP = 8);
- "sink_attention": `packed_attention.sink_attention` (gpt-oss's layers: sinks, a 128-token
  window) on a long-tailed packed row at gpt-oss-20b's attention shape, bf16 against fp32,
  forward and backward; its window against flash varlen_attn's (window_size (127, 0)) without
  sinks; time and peak memory against varlen's for the same row.
"""

import argparse
import functools
import importlib.util
import json
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchtitan_rl import platform  # noqa: E402  (plain torch, like the two below)
from torchtitan_rl.trainer import packed_attention  # noqa: E402
from torchtitan_rl.trainer.logprobs import head_logprobs  # noqa: E402


def gqa_shim_for_old_torch() -> str:
    """torch 2.11's varlen_attn has no `enable_gqa` (2.13's, which this project pins, has): on
    such a torch, wrap it to repeat the kv heads itself, so the checks still run the flash
    kernel through `packed_attention.varlen`. Returns what it did."""
    import inspect

    import torch.nn.attention.varlen as varlen_module

    original = varlen_module.varlen_attn
    if "enable_gqa" in inspect.signature(original).parameters:
        return "none"

    def varlen_attn(q, k, v, *args, enable_gqa=False, **kwargs):
        if enable_gqa and k.shape[-2] != q.shape[-2]:
            k, v = (x.repeat_interleave(q.shape[-2] // x.shape[-2], dim=-2) for x in (k, v))
        return original(q, k, v, *args, **kwargs)

    varlen_module.varlen_attn = varlen_attn
    return f"torch {torch.__version__}: varlen_attn lacks enable_gqa; kv heads repeated"


def docs_of(lengths: list[int], device) -> SimpleNamespace:
    """The `Documents` fields the kernels read (torchtitan's VarlenMetadata, without it)."""
    starts = [0]
    for length in lengths:
        starts.append(starts[-1] + length)
    cu = torch.tensor(starts, dtype=torch.int32, device=device)
    return SimpleNamespace(
        cu_seq_q=cu,
        cu_seq_k=cu,
        max_q=max(lengths),
        max_k=max(lengths),
        cu_seq_q_host=tuple(starts),
    )


def synced_ms(fn) -> tuple[object, float]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    began = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, 1000 * (time.perf_counter() - began)


def warm_ms(fn) -> tuple[object, float]:
    """`synced_ms` of a second call: the first pays for kernel selection and allocation."""
    fn()
    return synced_ms(fn)


def check_varlen(device, small: bool) -> dict:
    lengths = [37, 5, 9, 3] if small else [1811, 903, 377, 150, 64, 33, 17, 5, 1]
    N, K, H = (4, 2, 16) if small else (16, 8, 128)  # Qwen3-0.6B: 16 query, 8 kv heads of 128
    g = torch.Generator(device="cpu").manual_seed(0)
    L = sum(lengths)
    base = [torch.randn(1, L, heads, H, generator=g) for heads in (N, K, K)]
    docs = docs_of(lengths, device)
    grad_out = torch.randn(1, L, N, H, generator=g).to(device)

    def run(kernel, dtype, **kwargs):
        q, k, v = (x.to(device, dtype).requires_grad_() for x in base)
        out = kernel(q, k, v, docs, enable_gqa=True, **kwargs)
        out.backward(grad_out.to(dtype))
        return out.detach().float(), [x.grad.float() for x in (q, k, v)]

    bf16 = torch.bfloat16
    (out, grads), varlen_ms = warm_ms(lambda: run(packed_attention.varlen, bf16))
    (sdpa, sdpa_grads), sdpa_ms = warm_ms(lambda: run(packed_attention.sdpa_per_document, bf16))
    ref, ref_grads = run(packed_attention.sdpa_per_document, torch.float32)

    # Causal per document: a later token's key/value change leaves earlier outputs' bits.
    q, k, v = (x.to(device, bf16) for x in base)
    k2, v2 = k.clone(), v.clone()
    cut = lengths[0] // 2
    k2[:, cut : lengths[0]] += 1.0
    v2[:, cut : lengths[0]] -= 1.0
    with torch.no_grad():
        before = packed_attention.varlen(q, k, v, docs, enable_gqa=True)
        after = packed_attention.varlen(q, k2, v2, docs, enable_gqa=True)
        args, kwargs = packed_attention.varlen_arguments(q, k, v, docs, enable_gqa=True)
        from torch.nn.attention.varlen import varlen_attn

        full = varlen_attn(*args, enable_gqa=True).view_as(q)  # the kernel's default window
    grad_err = max((a - b).abs().max().item() for a, b in zip(grads, ref_grads, strict=True))
    sdpa_grad_err = max(
        (a - b).abs().max().item() for a, b in zip(sdpa_grads, ref_grads, strict=True)
    )
    return {
        "tokens": L,
        "documents": len(lengths),
        "fwd_max_err_vs_fp32": (out - ref).abs().max().item(),
        "sdpa_bf16_fwd_max_err_vs_fp32": (sdpa - ref).abs().max().item(),
        "bwd_max_err_vs_fp32": grad_err,
        "sdpa_bf16_bwd_max_err_vs_fp32": sdpa_grad_err,
        "fwd_max_diff_vs_sdpa_bf16": (out - sdpa).abs().max().item(),
        "causal_prefix_bitwise": bool(torch.equal(before[:, :cut], after[:, :cut])),
        "later_tokens_change": bool(not torch.equal(before[:, cut:], after[:, cut:])),
        "default_window_max_diff": (full.float() - before.float()).abs().max().item(),
        "fp32_runs_per_document": bool(
            torch.equal(
                packed_attention.varlen(*(x.to(device) for x in base), docs, enable_gqa=True),
                packed_attention.sdpa_per_document(*(x.to(device) for x in base), docs, None, True),
            )
        ),
        "varlen_fwd_bwd_ms": round(varlen_ms, 2),
        "sdpa_per_document_fwd_bwd_ms": round(sdpa_ms, 2),
    }


def peak_gib(device, fn) -> tuple[object, float]:
    if device.type != "cuda":
        return fn(), None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    return out, (torch.cuda.max_memory_allocated() - start) / 2**30


def check_head(device, small: bool) -> dict:
    tokens, vocab, dim = (512, 4096, 64) if small else (16384, 151936, 1024)
    g = torch.Generator(device="cpu").manual_seed(0)
    hidden = (torch.randn(tokens, dim, generator=g)).to(device, torch.bfloat16)
    weight = (torch.randn(vocab, dim, generator=g) * 0.02).to(device, torch.bfloat16)
    targets = torch.randint(0, vocab, (tokens,), generator=g).to(device)

    def chunked():
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logprobs, _ = head_logprobs(h, w, targets)
        logprobs.sum().backward()
        return logprobs.detach(), h.grad

    def full():
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logits = h @ w.t()
        logprobs = torch.log_softmax(logits.float(), -1).gather(-1, targets[:, None])[:, 0]
        logprobs.sum().backward()
        return logprobs.detach(), h.grad

    (chunked_lp, chunked_grad), chunked_gib = peak_gib(device, chunked)
    try:
        (full_lp, full_grad), full_gib = peak_gib(device, full)
    except torch.OutOfMemoryError:
        return {"tokens": tokens, "vocab": vocab, "chunked_peak_gib": chunked_gib, "full": "OOM"}
    return {
        "tokens": tokens,
        "vocab": vocab,
        "chunked_peak_gib": chunked_gib and round(chunked_gib, 3),
        "full_logits_peak_gib": full_gib and round(full_gib, 3),
        "peak_ratio": full_gib and round(chunked_gib / full_gib, 4),
        "logprob_max_diff": (chunked_lp - full_lp).abs().max().item(),
        "hidden_grad_max_diff": (chunked_grad.float() - full_grad.float()).abs().max().item(),
    }


def row_bits_across_batch(device, sizes=(1, 3, 16, 128, 1000)) -> dict:
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(max(sizes), 1024, generator=g).to(device, torch.bfloat16)
    w = torch.randn(4096, 1024, generator=g).to(device, torch.bfloat16)
    rows = [torch.mm(x[:m], w.t())[0] for m in sizes]
    softmax = [torch.log_softmax(torch.mm(x[:m], w.t()).float(), -1)[0] for m in sizes]
    return {
        "mm_row_invariant": all(torch.equal(rows[0], r) for r in rows),
        "log_softmax_row_invariant": all(torch.equal(softmax[0], r) for r in softmax),
    }


def check_batch_invariance(device, small: bool) -> dict:
    """Plain rows; then, where vLLM runs (a GPU with the `gpu` extra), its in-tree kernels
    (what `platform.enable_batch_invariance` installs) and the trainer's attention under the
    mode (batch_invariant/flash.py): vLLM's flash forward against torch's varlen_attn, a
    sequence alone against the same sequence among others (bitwise), the gradient."""
    figures = {"plain": row_bits_across_batch(device)}
    if device.type != "cuda" or importlib.util.find_spec("vllm") is None:
        figures["vllm_kernels"] = "not run: needs vLLM's CUDA build on a GPU"
        return figures
    platform.enable_batch_invariance()  # as a run under the mode: VLLM_BATCH_INVARIANT, then vLLM's
    figures["vllm_kernels"] = row_bits_across_batch(device)
    figures["flash"] = flash_against_varlen(device, small)
    return figures


def flash_against_varlen(device, small: bool) -> dict:
    """batch_invariant/flash.py's attention on a long-tailed packed bf16 row at Qwen3-0.6B's
    attention shape (it imports torchtitan, which the `gpu` extra that brings vLLM has)."""
    from torchtitan_rl.batch_invariant import flash

    lengths = [40, 9, 130, 3] if small else [1800, 120, 64, 4000, 17, 900]
    N, K, H = (4, 2, 16) if small else (16, 8, 128)
    g = torch.Generator(device="cpu").manual_seed(0)
    L = sum(lengths)
    q, k, v = (
        torch.randn(1, L, heads, H, generator=g).to(device, torch.bfloat16).requires_grad_()
        for heads in (N, K, K)
    )
    docs = docs_of(lengths, device)
    out = flash.attention(q, k, v, docs)
    reference = packed_attention.varlen(q, k, v, docs, enable_gqa=True)
    alone_docs = docs_of(lengths[2:3], device)
    span = slice(sum(lengths[:2]), sum(lengths[:3]))
    alone = flash.attention(*(x[:, span] for x in (q, k, v)), alone_docs)
    upstream = torch.randn(out.shape, generator=g).to(device, torch.bfloat16)
    grads = torch.autograd.grad(out, (q, k, v), upstream)
    reference_grads = torch.autograd.grad(reference, (q, k, v), upstream)
    return {
        "forward_max_diff_vs_varlen": (out - reference).abs().max().item(),
        "sequence_alone_bitwise": torch.equal(alone, out[:, span]),
        "grad_max_diff_vs_varlen": max(
            (a - b).abs().max().item() for a, b in zip(grads, reference_grads, strict=True)
        ),
    }


def check_process_groups(device) -> dict:
    import torch.distributed as dist

    rank, world = platform.init_distributed(120)  # a world of one: cpu:gloo,cuda:nccl on a GPU
    host = torch.tensor([1.0, 2.0])
    platform.all_reduce_host(host)
    on_device = torch.ones(4, device=device)
    dist.all_reduce(on_device)
    subgroup = dist.new_group([0])
    platform.all_reduce_host(host, group=subgroup)
    dist.all_reduce(on_device, group=subgroup)
    return {
        "backend": platform.dist_backend(),
        "world": world,
        "host_all_reduce": host.tolist() == [1.0, 2.0],
        "device_all_reduce": on_device.tolist() == [1.0] * 4,
        "objects": platform.all_gather_objects({"rank": rank}) == [{"rank": 0}],
    }


def check_grouped_mm(device, small: bool) -> dict:
    E, D, G = (4, 64, 128) if small else (4, 2880, 5760)  # gpt-oss-20b: mlp1 [E, 2F, D]
    counts = [37, 0, 5, 90] if small else [1500, 0, 600, 1996]
    g = torch.Generator(device="cpu").manual_seed(0)
    x_cpu = torch.randn(sum(counts), D, generator=g)
    w_cpu = torch.randn(E, G, D, generator=g) * D**-0.5
    offsets = torch.cumsum(torch.tensor(counts), 0).to(device, torch.int32)
    figures = {"rows": sum(counts), "experts": E, "dim": D, "out": G}
    reference = torch.cat(
        [x.double() @ w.double().t() for x, w in zip(x_cpu.split(counts), w_cpu, strict=True)]
    )
    for dtype in (torch.float32, torch.bfloat16):
        x, w = x_cpu.to(device, dtype), w_cpu.to(device, dtype)
        try:
            out, grouped_ms = warm_ms(
                lambda x=x, w=w: torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)
            )
        except Exception as e:  # noqa: BLE001  (a dtype without a kernel is this figure)
            figures[str(dtype)] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
            continue
        loop, loop_ms = warm_ms(
            lambda x=x, w=w: torch.cat([a @ b.t() for a, b in zip(x.split(counts), w, strict=True)])
        )
        figures[str(dtype).removeprefix("torch.")] = {
            "max_err_vs_fp64": (out.double().cpu() - reference).abs().max().item(),
            "loop_max_err_vs_fp64": (loop.double().cpu() - reference).abs().max().item(),
            "out_dtype": str(out.dtype).removeprefix("torch."),
            "grouped_ms": round(grouped_ms, 3),
            "loop_ms": round(loop_ms, 3),
        }
    return figures


def check_sink_attention(device, small: bool) -> dict:
    lengths = [37, 5, 20, 3] if small else [1811, 903, 377, 150, 64, 33, 17, 5, 1]
    N, K, H, window = (4, 2, 16, 8) if small else (64, 8, 64, 128)  # gpt-oss-20b's attention
    g = torch.Generator(device="cpu").manual_seed(0)
    L = sum(lengths)
    base = [torch.randn(1, L, heads, H, generator=g) for heads in (N, K, K)]
    sinks_cpu = torch.randn(N, generator=g)
    docs = docs_of(lengths, device)
    grad_out = torch.randn(1, L, N, H, generator=g).to(device)

    def rescale(sinks):  # torchtitan's gpt-oss apply_attention_sink_rescale
        def transform(out, lse):
            return out * torch.sigmoid(lse - sinks.view(1, 1, -1)).unsqueeze(-1).to(out.dtype)

        return transform

    def run(dtype, kernel=None):
        q, k, v = (x.to(device, dtype).requires_grad_() for x in base)
        sinks = sinks_cpu.to(device).requires_grad_()
        if kernel is None:

            def kernel(q, k, v, **kwargs):
                return packed_attention.sink_attention(
                    q, k, v, window=window, out_transform=rescale(sinks), **kwargs
                )

        out = packed_attention.per_document(kernel, q, k, v, docs, enable_gqa=True)
        out.backward(grad_out.to(dtype))
        return out.detach().float(), [x.grad.float() for x in (q, k, v, sinks)]

    (out, grads), sink_gib = peak_gib(device, lambda: run(torch.bfloat16))
    _, sink_ms = warm_ms(lambda: run(torch.bfloat16))
    ref, ref_grads = run(torch.float32)
    figures = {
        "tokens": L,
        "window": window,
        "fwd_max_err_vs_fp32": (out - ref).abs().max().item(),
        "bwd_max_err_vs_fp32": max(
            (a - b).abs().max().item() for a, b in zip(grads, ref_grads, strict=True)
        ),
        "sink_attention_fwd_bwd_ms": round(sink_ms, 2),
        "sink_attention_peak_gib": sink_gib and round(sink_gib, 3),
    }
    if device.type != "cuda":
        return figures
    from torch.nn.attention.varlen import varlen_attn

    def flash(dtype, window_size):
        q, k, v = (x.to(device, dtype).requires_grad_() for x in base)
        args, kwargs = packed_attention.varlen_arguments(q, k, v, docs, enable_gqa=True)
        out = varlen_attn(*args, **{**kwargs, "window_size": window_size}).view_as(q)
        out.backward(grad_out.to(dtype))
        return out.detach().float()

    (flash_out, flash_gib) = peak_gib(device, lambda: flash(torch.bfloat16, (window - 1, 0)))
    _, flash_ms = warm_ms(lambda: flash(torch.bfloat16, (window - 1, 0)))
    q, k, v = (x.to(device, torch.bfloat16) for x in base)
    with torch.no_grad():
        windowed = packed_attention.per_document(
            functools.partial(packed_attention.sink_attention, window=window),
            q, k, v, docs, enable_gqa=True,
        ).float()  # fmt: skip
    figures |= {
        "window_vs_flash_max_diff": (windowed - flash_out).abs().max().item(),
        "flash_window_fwd_bwd_ms": round(flash_ms, 2),
        "flash_window_peak_gib": round(flash_gib, 3),
    }
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="small shapes (CPU runs)")
    args = parser.parse_args()
    device = platform.device()
    figures: dict = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
    }
    if device.type == "cuda":
        figures["gqa_shim"] = gqa_shim_for_old_torch()
    began = time.perf_counter()
    checks = {
        "varlen": lambda: check_varlen(device, args.small),
        "head": lambda: check_head(device, args.small),
        "batch_invariance": lambda: check_batch_invariance(device, args.small),
        "process_groups": lambda: check_process_groups(device),
        "grouped_mm": lambda: check_grouped_mm(device, args.small),
        "sink_attention": lambda: check_sink_attention(device, args.small),
    }
    for name, check in checks.items():
        try:
            figures[name] = check()
        except Exception as e:  # noqa: BLE001  (one check's failure is that check's figure)
            traceback.print_exc(file=sys.stderr)
            figures[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    figures["wall_s"] = round(time.perf_counter() - began, 1)
    print(json.dumps(figures))
    platform.shutdown_distributed()


if __name__ == "__main__":
    main()
