"""CPU platform choices: device, backend, torchtitan device patch, SDPA attention.

.venv/bin/python -m pytest tests/unit/test_platform.py
"""

import ast
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from torchtitan_rl import platform
from torchtitan_rl.models import model_spec
from torchtitan_rl.trainer import attention
from torchtitan_rl.trainer.attention import DocumentCausalAttention


def test_cpu_choices():
    assert platform.device_type() == "cpu"
    assert platform.dist_backend() == "gloo"
    assert platform.spmd_backend() == "partial_dtensor"
    assert platform.packed_attention_kernel() is attention.sdpa_per_document


def test_patch_points_torchtitan_at_cpu():
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.tools.utils as titan_utils

    platform.patch_torchtitan()
    assert titan_utils.device_type == "cpu"
    assert parallel_dims.device_type == "cpu"


def test_sdpa_attention_runs_forward_and_backward_on_cpu():
    spec = model_spec("qwen3", "tiny")
    platform.use_platform_attention(spec.model)
    assert all(
        isinstance(layer.attention.inner_attention, DocumentCausalAttention.Config)
        and layer.attention.inner_attention.packed is attention.sdpa_per_document
        for layer in spec.model.layers
    )
    torch.manual_seed(0)
    model = spec.model.build()
    model.init_states()
    tokens_BT = torch.randint(0, 64, (2, 12))
    positions_BT = torch.arange(12).expand(2, 12)
    logits_BTV = model(tokens_BT, positions=positions_BT)
    logits_BTV.float().logsumexp(-1).mean().backward()
    assert logits_BTV.shape == (2, 12, 68)
    assert all(p.grad is not None and p.grad.isfinite().all() for p in model.parameters())

    # Causal: changing a later token leaves earlier logits unchanged.
    changed_BT = tokens_BT.clone()
    changed_BT[:, 8] = (changed_BT[:, 8] + 1) % 64
    with torch.no_grad():
        again = model(changed_BT, positions=positions_BT)
    torch.testing.assert_close(again[:, :8], logits_BTV[:, :8].detach(), rtol=0, atol=0)
    assert not torch.equal(again[:, 8:], logits_BTV[:, 8:].detach())


def test_cuda_choices_route_host_figures_through_gloo(monkeypatch):
    """What the CUDA run gets (checked on an H100 too, see README): one process group whose
    CPU tensors go through gloo and device tensors through NCCL, and the same SDPA attention
    as on CPU for padded rows; varlen flash attention for packed bf16 ones (fp32 ones, which
    flash attention has no kernel for, SDPA per document)."""
    monkeypatch.setattr(platform, "device_type", lambda: "cuda")
    assert platform.packed_attention_kernel("bfloat16") is attention.varlen
    assert platform.packed_attention_kernel("float32") is attention.sdpa_per_document
    assert platform.dist_backend() == "cpu:gloo,cuda:nccl"
    spec = model_spec("qwen3", "tiny")
    platform.use_platform_attention(spec.model, "bfloat16")
    assert all(
        isinstance(layer.attention.inner_attention, DocumentCausalAttention.Config)
        and layer.attention.inner_attention.packed is attention.varlen
        for layer in spec.model.layers
    )


def test_host_reductions_refuse_device_tensors():
    with pytest.raises(ValueError, match="takes host tensors, got one on meta"):
        platform.all_reduce_host(torch.zeros(2, device="meta"))


def test_engine_child_leaves_the_torchrun_world_but_keeps_its_device(monkeypatch):
    import os

    from torchtitan_rl.generator.remote import outside_torchrun

    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("LOCAL_RANK", "3")
    with outside_torchrun():
        assert os.environ["LOCAL_RANK"] == "3"  # the rank's GPU, not every child on cuda:0
        assert not {"RANK", "WORLD_SIZE", "MASTER_PORT"} & set(os.environ)
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"]) == ("3", "4")
    monkeypatch.delenv("LOCAL_RANK")
    with outside_torchrun():
        assert os.environ["LOCAL_RANK"] == "0"
    assert "LOCAL_RANK" not in os.environ


def test_shared_memory_gather_needs_room_in_dev_shm(monkeypatch, capsys):
    """Where /dev/shm cannot hold the slots (a container's default is 64 MB), the process
    group's all-gather serves instead of a SIGBUS, and one line (once) says so and how to give
    it room; where it can, every rank reads every slot."""
    import os
    from types import SimpleNamespace

    platform.init_distributed()  # a world of one
    group = dist.group.WORLD
    small = SimpleNamespace(f_bavail=256, f_frsize=4096)  # 1 MiB free
    monkeypatch.setattr(os, "statvfs", lambda path: small)
    platform._note_small_dev_shm.cache_clear()
    assert platform.host_shared_gather(group, slot_bytes=1 << 20) is None
    assert platform.host_shared_gather(group, slot_bytes=1 << 20) is None
    (line,) = capsys.readouterr().err.splitlines()
    assert "/dev/shm has 1 MiB free, its shared-memory gather needs 2 MiB" in line
    assert "gather through gloo" in line and "--shm-size" in line
    platform._note_small_dev_shm.cache_clear()
    monkeypatch.undo()
    shared = platform.host_shared_gather(group, slot_bytes=64)
    slot = shared.my_slot(4, torch.float32)
    slot.copy_(torch.arange(4.0))
    assert shared.gather(4, torch.float32).tolist() == [[0.0, 1.0, 2.0, 3.0]]
    with pytest.raises(ValueError, match="does not fit a 64-byte slot"):
        shared.my_slot(17, torch.float32)


def test_every_process_group_takes_the_collective_timeout():
    """torch gives a group created after the world (a device mesh's, dist.new_group) its own
    default (30 min on gloo); init_distributed makes it the run's job.collective_timeout_s."""
    platform.init_distributed()  # a world of one, timeout_s = 600 (as every unit test calls it)
    world = dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout
    later = dist.new_group([0])._get_backend(torch.device("cpu")).options._timeout
    assert world.total_seconds() == later.total_seconds() == 600


def test_every_torchrun_script_of_the_tests_ends_through_exit_process():
    """A 2-rank gloo process that ends through the interpreter aborts now and then after its
    work is done (`platform.exit_process` says how often): every tests/dist script ends its
    process through `platform.exit_process`, as train.py and sft.py do."""
    scripts = sorted((Path(__file__).resolve().parents[1] / "dist").glob("*_run.py"))
    assert scripts
    for script in scripts:
        main = [
            node
            for node in ast.parse(script.read_text()).body
            if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)
        ]
        assert main and "platform.exit_process(" in ast.unparse(main[-1]), script.name
