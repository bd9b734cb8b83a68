"""Counting, on CPU, the calls that make the host wait for a GPU: each reads a device tensor's
values (or sizes an output by them) on the host, so on CUDA it waits for every kernel queued
before it (`torch.cuda.set_sync_debug_mode` flags the same ones there).

    .venv/bin/python -m pytest tests/unit/test_model.py -k host

On CPU nothing waits, so the count is of the calls, by where our code made them: the aten ops
seen by a TorchDispatchMode (`.item()`, `bool(t)`, `float(t)` and `int(t)` are
`_local_scalar_dense`; a boolean index is `index.Tensor` with a bool index, which runs
`nonzero` inside), and the tensor methods that read a tensor's memory without an aten op,
seen by a TorchFunctionMode (`tolist`, `numpy`, `cpu`). A host tensor read this way costs
nothing on CUDA, and is counted all the same: the test says which are. Not seen: `.to("cpu")`
(on CPU every `.to(tensor.device)` looks alike), so the project reads the device with
`.cpu()`, `.tolist()` or `.item()`.
"""

import collections
import traceback
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
# Ops whose output's values or size come from a tensor's values.
SYNC_OPS = {
    aten._local_scalar_dense.default,
    aten.nonzero.default,
    aten.nonzero_static.default,
    aten.masked_select.default,
    aten._unique2.default,
    aten.unique_consecutive.default,
    aten.unique_dim.default,
    aten.equal.default,
    aten.is_nonzero.default,
    aten.repeat_interleave.Tensor,
}
READ_METHODS = {torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu}
# Where a train step plans on the host: these read the host loss mask (on CUDA, CPU memory: no
# wait), a fixed number of times however many micro-batches there are.
HOST_PLANNERS = {
    "packing.needed",
    "packing.all_lengths",
    "packing.<listcomp>",
    "packing.plan",
    "packing.deal",
    "packing.padded_scale",
    "policy_trainer.plan",
}
# Where a step with images plans on the host: these read the rows' image grids and the host
# plan (CPU memory on CUDA too: no wait), once per micro-batch.
IMAGE_PLANNERS = {"policy_trainer._vision", "vision.each_image", "vision.encoder_rows"}
PACKAGE = str(Path(__file__).resolve().parents[2] / "torchtitan_rl")
# The modes' own frames and torch's dispatch machinery between the caller and the mode.
_SKIPPED = (
    __file__,
    torch.overrides.__file__,
    torch.utils._python_dispatch.__file__,
    *(str(Path(torch.__file__).parent / name) for name in ("_tensor.py", "_compile.py")),
    str(Path(torch.__file__).parent / "_dynamo" / "eval_frame.py"),
)


def _where() -> tuple[str, str | None]:
    """Who made the call: ("module.function" of torchtitan_rl, None) when our code made it,
    else ("library < module.function", the library's "module.function" that made it), the
    library called from the innermost function of ours."""
    frames = [f for f in traceback.extract_stack() if not f.filename.startswith(_SKIPPED)]
    ours = next((f for f in reversed(frames) if f.filename.startswith(PACKAGE)), None)
    name = "?" if ours is None else f"{Path(ours.filename).stem}.{ours.name}"
    if frames[-1] is ours:
        return name, None
    return f"library < {name}", f"{Path(frames[-1].filename).stem}.{frames[-1].name}"


def _bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(i is not None and i.dtype == torch.bool for i in indices)


def _record(syncs: "HostSyncs", call: str) -> None:
    where, library = _where()
    syncs.calls.append((call, where))
    if library is not None:
        syncs.library.append((call, library, where))


class _Ops(TorchDispatchMode):
    def __init__(self, syncs):
        super().__init__()
        self.syncs = syncs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in SYNC_OPS or (func is aten.index.Tensor and _bool_index(args)):
            _record(self.syncs, func.__name__)
        return func(*args, **kwargs)


class _Methods(TorchFunctionMode):
    def __init__(self, syncs):
        super().__init__()
        self.syncs = syncs

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in READ_METHODS:
            _record(self.syncs, func.__name__)
        return func(*args, **kwargs)


class HostSyncs:
    """Context manager: `counts` maps (op or method, innermost torchtitan_rl function) to the
    number of calls made inside; `calls` lists them in order."""

    def __init__(self):
        self.calls: list[tuple[str, str]] = []
        """Each call, in order: (op or method, innermost torchtitan_rl function)."""
        self.library: list[tuple[str, str, str]] = []
        """The calls a library made, in order: (op or method, the library's "module.function"
        that made it, `calls`' "library < ..." caller)."""
        self._modes = (_Methods(self), _Ops(self))

    @property
    def counts(self) -> collections.Counter:
        return collections.Counter(self.calls)

    def __enter__(self):
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc):
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    def by_function(self) -> dict[str, int]:
        """Calls per caller (`_where`)."""
        totals: collections.Counter = collections.Counter()
        for (_, where), n in self.counts.items():
            totals[where] += n
        return dict(totals)
