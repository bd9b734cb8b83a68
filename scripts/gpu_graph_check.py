"""A torchtitan MoE decoder layer under CUDA graphs, as the generator runs it; one JSON line.

    scripts/gpu_wheels.sh     (here: the wheels into .whl/, which the GPU machine is given)
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl &&
        PYTHONPATH=$PWD/scripts/gpu_shim:/tmp/site:$PWD python3 scripts/gpu_graph_check.py
    .venv/bin/python scripts/gpu_graph_check.py --small      (CPU: debugmodel_moe, no graphs)
    ... scripts/gpu_graph_check.py --model deepseek_v3 --flavor 671B   (DeepSeek-V3's 4th layer:
        latent attention, 256 experts in 8 groups, 8 per token from 4 groups, a shared expert)

For a GPU machine with torch and no network, no vLLM and no torchtitan: `.whl/` (ignored by
git) holds torchtitan 0.3.0's wheel and those of its dependencies that importing
`torchtitan.models.qwen3` and this project's model and trainer code need (scripts/gpu_wheels.sh).
torchtitan 0.3.0 does not import on torch 2.11 (measured on a lent H100: no
`torch.distributed.fsdp.DataParallelMeshDims`); scripts/gpu_shim/sitecustomize.py gives it a
stand-in of that dataclass's fields. Nothing here imports vLLM. Two checks, each its own JSON key,
each catching its own error so that one failure does not hide the other:

- "torchtitan": torchtitan imports on this torch (`torchtitan.models.qwen3`, then
  `platform.patch_torchtitan()`), and whether vLLM got imported on the way (it must not).
- "decoder_layer_graph": the first MoE layer of `models.model_spec(model, flavor)` (the
  project's MoE `Router` and `Experts`; default qwen3 30B-A3B: dim 2048, 32/4 heads of 128, 128
  experts of 768, top 8), built alone, in eval mode, bf16. Its forward `layer(h_1TD, None,
  positions_1T)` is the one `generator/vllm_model.Decoder` runs per layer; the router writes its
  expert ids in place into a preallocated `Router.capture_TK` [rows, K] on the device. For each
  token count T (one graph per T, as vLLM captures one per batch size): warm up on a side
  stream, capture into a `torch.cuda.CUDAGraph` over static input buffers, then for fresh random
  inputs compare the eager forward with a replay: the output bitwise (torch.equal) and the
  routing buffer's first T rows against the eager run's. Per T: the flags, and eager ms against
  replay ms. Two modes, each built afresh: "plain" (the trainer's platform attention, causal
  SDPA; grouped-GEMM experts) and then "batch_invariant" (this project's torch-only kernels:
  `use_invariant_attention`, `make_linears_invariant`). "host_sync" names the first host
  synchronisation in an eager forward (CUDA's sync debug mode), which a graph cannot hold; a
  mode stops at its first failed capture. Expected there: batch-invariant experts (models/moe.py
  `_looped`) read each expert's token count on the host (`.tolist()`).

The inner attention is the trainer's stand-in for the generator's: in the engine the layer's
inner attention is vLLM's paged `Attention`, or in batch-invariant mode
`generator/attention.paged_attend`, which reads vLLM's metadata on the host and so is
deliberately not captured (a piecewise graph's split point); on CUDA the batch-invariant
generator runs vLLM's own kernels (VLLM_BATCH_INVARIANT=1), not `batch_invariant.ops`.
On CPU (`--small`) there are no CUDA graphs: the eager forward runs twice, the second run
standing in for the replay, and the output says so.
"""

import argparse
import contextlib
import functools
import json
import sys
import time
import traceback
from importlib import metadata
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WARMUP = 3  # side-stream forwards before a capture (torch's CUDA graph docs)


def error(e: BaseException) -> dict:
    """A check's failure as its figure: the exception's type and first line, with those of
    the exception it was raised while handling (a failed capture's end hides its cause)."""
    figure = {"error": f"{type(e).__name__}: {(str(e).strip() or '-').splitlines()[0][:300]}"}
    if e.__context__ is not None:
        figure["during"] = error(e.__context__)["error"]
    return figure


def where(e: BaseException) -> str:
    """The innermost frame of torchtitan or this project that raised `e`, as path:line."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if "torchtitan" in f.filename]
    if not frames:
        return "?"
    frame = frames[-1]
    path = frame.filename.split("site-packages/")[-1].split(str(Path.cwd()) + "/")[-1]
    return f"{path}:{frame.lineno} ({frame.line})"


def check_torchtitan() -> dict:
    """torchtitan's import on this torch, and that no vLLM came with it."""
    began = time.perf_counter()
    import torchtitan.models.deepseek_v3  # noqa: F401
    import torchtitan.models.qwen3  # noqa: F401

    from torchtitan_rl import platform

    platform.patch_torchtitan()
    return {
        "ok": True,
        "version": metadata.version("torchtitan"),
        "from": str(Path(torchtitan.__file__).parent),
        "import_s": round(time.perf_counter() - began, 2),
        "vllm_imported": sys.modules.get("vllm") is not None,
    }


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """Build parameters in `dtype`, as vLLM builds its models (fp32 buffers stay fp32)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_layer(args, invariant: bool, dtype: torch.dtype, device: torch.device, rows: int):
    """The first MoE layer of `args.model`/`args.flavor` as the project builds it, on
    `device`, its router capturing into a [rows, K] int32 buffer. Returns (layer, router,
    dim)."""
    from torchtitan_rl import batch_invariant, platform
    from torchtitan_rl.models import model_spec
    from torchtitan_rl.models.moe import routers

    spec = model_spec(args.model, args.flavor)
    platform.use_platform_attention(spec.model, str(dtype).removeprefix("torch."))
    if invariant:
        batch_invariant.use_invariant_attention(spec.model)
    torch.manual_seed(0)
    first_moe = next(c for c in spec.model.layers if getattr(c, "moe", None) is not None)
    with torch.device(device), default_dtype(dtype):
        layer = first_moe.build()
    with torch.no_grad():
        layer.init_states(buffer_device=device)
    if invariant:
        batch_invariant.make_linears_invariant(layer)
    layer.eval()  # vLLM's loader returns model.eval(): no expert-usage counting
    (router,) = routers(layer)
    router.capture_TK = torch.full((rows, router.top_k), -1, dtype=torch.int32, device=device)
    return layer, router, spec.model.dim


def timed_ms(fn, device: torch.device, n: int) -> float:
    """Mean wall ms of `fn()` over `n` calls after one warm call, device work included."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(n):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return round((time.perf_counter() - began) * 1e3 / n, 3)


def host_sync(layer, h_1TD, positions_1T) -> str | None:
    """Where an eager forward first synchronises with the host (None: nowhere), by CUDA's
    sync debug mode: such a forward cannot be captured."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer(h_1TD, None, positions_1T)
        return None
    except RuntimeError as e:
        return f"{where(e)}: {str(e).splitlines()[0][:120]}"
    finally:
        torch.cuda.set_sync_debug_mode("default")


def capture(layer, h_1TD, positions_1T):
    """(graph, static output) of `layer`'s forward over the static inputs, warmed up on a
    side stream first as torch's docs require."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(WARMUP):
            layer(h_1TD, None, positions_1T)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_1TD = layer(h_1TD, None, positions_1T)
    return graph, out_1TD


def inputs(T: int, dim: int, dtype, device, generator, positions: int = 4096):
    """Random hidden states [1, T, D] and `positions` [1, T] (RoPE's, any order, below the
    model's)."""
    h_1TD = torch.randn(1, T, dim, generator=generator, device=device).to(dtype)
    positions_1T = torch.randint(0, positions, (1, T), generator=generator, device=device)
    return h_1TD, positions_1T


def graph_vs_eager(layer, router, dim, dtype, device, T: int, args, figures: dict) -> None:
    """One graph at T tokens (CUDA; on CPU a second eager run), replayed on `args.rounds` fresh
    inputs, against the eager forward on each; fills `figures` as it goes (a failed capture
    keeps what came before it)."""
    generator = torch.Generator(device=device).manual_seed(T)
    positions = min(4096, layer.attention.rope.config.max_seq_len)  # the layer's RoPE's
    static_h, static_pos = inputs(T, dim, dtype, device, generator, positions)
    if device.type == "cuda":
        figures["host_sync"] = host_sync(layer, static_h, static_pos)
        graph, static_out = capture(layer, static_h, static_pos)

        def replay():
            graph.replay()
            return static_out
    else:

        def replay():
            return layer(static_h, None, static_pos)

    output_equal, routing_equal, max_diff = True, True, 0.0
    for _ in range(args.rounds):
        h_1TD, positions_1T = inputs(T, dim, dtype, device, generator, positions)
        router.capture_TK.fill_(-1)
        eager_1TD = layer(h_1TD, None, positions_1T).clone()
        eager_ids_TK = router.capture_TK[:T].clone()
        static_h.copy_(h_1TD)
        static_pos.copy_(positions_1T)
        router.capture_TK.fill_(-1)
        replayed_1TD = replay().clone()
        replayed_ids_TK = router.capture_TK[:T].clone()
        output_equal &= torch.equal(eager_1TD, replayed_1TD)
        routing_equal &= torch.equal(eager_ids_TK, replayed_ids_TK) and bool(
            (eager_ids_TK >= 0).all()
        )
        max_diff = max(max_diff, (eager_1TD.float() - replayed_1TD.float()).abs().max().item())
    figures.update(output_equal=output_equal, routing_equal=routing_equal, rounds=args.rounds)
    if not output_equal:
        figures["max_abs_diff"] = max_diff
    eager = functools.partial(layer, static_h, None, static_pos)
    figures["eager_ms"] = timed_ms(eager, device, args.timing_calls)
    figures["replay_ms"] = timed_ms(replay, device, args.timing_calls)


def check_mode(invariant: bool, args, device: torch.device) -> dict:
    """Every T of one mode; stops at the first T that fails (a failed capture may leave the
    stream unusable for the next)."""
    dtype = getattr(torch, args.dtype)
    layer, router, dim = build_layer(args, invariant, dtype, device, max(args.tokens))
    figures: dict = {}
    with torch.inference_mode():
        for T in args.tokens:
            figures[f"T={T}"] = figure = {}
            try:
                graph_vs_eager(layer, router, dim, dtype, device, T, args, figure)
            except Exception as e:  # noqa: BLE001  (this T's failure is its figure)
                traceback.print_exc(file=sys.stderr)
                figure.update(error(e), at=where(e))
                break
    del layer, router
    if device.type == "cuda":
        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001  (a failed capture's aftermath: keep the figures)
            figures["cleanup"] = error(e)
    return figures


def check_decoder_layer_graph(args, device: torch.device) -> dict:
    """Both modes, plain first: a failed capture in the second cannot spoil the first."""
    figures: dict = {
        "model": args.model,
        "flavor": args.flavor,
        "dtype": args.dtype,
        "graph": "torch.cuda.CUDAGraph per T"
        if device.type == "cuda"
        else "none on CPU: the eager forward run twice, the second standing in for the replay",
    }
    for name, invariant in (("plain", False), ("batch_invariant", True)):
        try:
            figures[name] = check_mode(invariant, args, device)
        except Exception as e:  # noqa: BLE001  (one mode's failure is that mode's figure)
            traceback.print_exc(file=sys.stderr)
            figures[name] = {**error(e), "at": where(e)}
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="CPU smoke test: debugmodel_moe, fp32")
    parser.add_argument("--model", default="qwen3", help="the family (qwen3, deepseek_v3, ...)")
    parser.add_argument("--flavor", help="an MoE flavor (30B-A3B; --small: debugmodel_moe)")
    parser.add_argument("--dtype", help="parameter dtype (default bfloat16; --small: float32)")
    parser.add_argument("--tokens", type=int, nargs="+", help="token counts T (default 1 8 64 256)")
    parser.add_argument("--rounds", type=int, default=2, help="fresh inputs compared per T")
    parser.add_argument("--timing-calls", type=int, help="calls timed per figure (20; --small 3)")
    args = parser.parse_args()
    args.flavor = args.flavor or ("debugmodel_moe" if args.small else "30B-A3B")
    args.dtype = args.dtype or ("float32" if args.small else "bfloat16")
    args.tokens = args.tokens or ([1, 8, 64] if args.small else [1, 8, 64, 256])
    args.timing_calls = args.timing_calls or (3 if args.small else 20)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.small else "cpu")
    figures: dict = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
    }
    began = time.perf_counter()
    checks = {
        "torchtitan": check_torchtitan,
        "decoder_layer_graph": lambda: check_decoder_layer_graph(args, device),
    }
    for name, check in checks.items():
        try:
            figures[name] = check()
        except Exception as e:  # noqa: BLE001  (one check's failure is that check's figure)
            traceback.print_exc(file=sys.stderr)
            figures[name] = {**error(e), "at": where(e)}
    figures["vllm_imported"] = sys.modules.get("vllm") is not None
    figures["wall_s"] = round(time.perf_counter() - began, 1)
    print(json.dumps(figures), flush=True)


if __name__ == "__main__":
    main()
