"""The experts the generator routed each token to, by request: what the trainer compares its
own routing with (`moe/routing_mismatch`) and replays (`algorithm.router_replay`).

    .venv/bin/python -m pytest tests/integration/test_moe.py

vLLM 0.32 returns routed experts (`enable_return_routed_experts`) only from its GPU model
runner; its CPU runner has no capture. So the wrapper captures them itself, the way vLLM's own
capturer does: each router of the torchtitan model writes its top-k ids into a buffer
preallocated at build (`Router.capture_TK`, one row per token of the largest batch), in place,
inside the (compiled) forward; after the forward, on the host, `commit` files the step's rows
under their requests, using the step's attention metadata (where each request's rows start)
and the model runner's batch (which request each is). A request's routing is then one
[T, M, K] tensor (M: the MoE layers), -1 at the positions this engine did not run: the last
token (sampled, never fed back) and prompt blocks served from the prefix cache.

The runner's batch is the V1 model runner's `input_batch`; platform.py pins that runner on
CUDA, where vLLM would otherwise pick its V2 runner, which has none.
"""

import functools
import re

import torch
from torch.distributed.tensor import DTensor


class RoutingLog:
    """Per request id, the expert ids of the positions the engine ran."""

    def __init__(self, routers: list, rows: int):
        """`rows`: the most tokens one forward runs (vLLM's max_num_batched_tokens, and a
        tensor-parallel generator's padding)."""
        self.routers = routers
        self.runner = None
        """vLLM's model runner, whose `input_batch` lists the step's requests in row order
        (bound by `LocalGenerator` once the engine exists)."""
        self._steps: list[tuple[torch.Tensor, torch.Tensor, list[str], list[int]]] = []
        """Steps filed since the last `take`: (positions_T, ids_TMK, the request of each run
        of rows, the run's rows), grouped by request when a request is next taken."""
        self._requests: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        """Per request, (positions, ids_RMK) of its rows in each group of steps, in order."""
        for router in routers:
            weight = router.gate.weight
            device = weight.to_local().device if isinstance(weight, DTensor) else weight.device
            router.capture_TK = torch.full(
                (rows, router.top_k), -1, dtype=torch.int32, device=device
            )

    def commit(self, positions_T: torch.Tensor, tokens: int) -> None:
        """File the ids this forward's routers wrote for its `tokens` rows under the requests
        they belong to (a dummy forward, without metadata or runner, files nothing)."""
        from vllm.forward_context import get_forward_context, is_forward_context_available

        from torchtitan_rl.generator.attention import metadata_of

        if self.runner is None or not is_forward_context_available():
            return
        metadata = metadata_of(get_forward_context().attn_metadata, None)
        if metadata is None:
            return
        ids_TMK = torch.stack([r.capture_TK[:tokens] for r in self.routers], dim=1)
        starts = metadata.query_start_loc.tolist()
        # Copies: vLLM reuses its buffers every step.
        self.file(positions_T.to("cpu", copy=True), ids_TMK.to("cpu", torch.int16), starts)

    def file(self, positions_T: torch.Tensor, ids_TMK: torch.Tensor, starts: list[int]) -> None:
        """File a step's rows: request i of the runner's batch ran rows starts[i]:starts[i+1]."""
        request_ids = self.runner.input_batch.req_ids
        requests, rows = [], []
        for i in range(len(starts) - 1):
            if starts[i + 1] > starts[i]:
                requests.append(_external(request_ids[i]))
                rows.append(starts[i + 1] - starts[i])
        self._steps.append((positions_T[: starts[-1]], ids_TMK[: starts[-1]], requests, rows))

    def _group(self) -> None:
        """Group the steps filed since the last call by request, in one sort (per request and
        step, slicing was a tenth of a tiny MoE engine's host time): each request's rows,
        in step order."""
        if not self._steps:
            return
        positions_R = torch.cat([step[0] for step in self._steps])
        ids_RMK = torch.cat([step[1] for step in self._steps])
        names = list(dict.fromkeys(name for step in self._steps for name in step[2]))
        index = {name: i for i, name in enumerate(names)}
        slots = [index[name] for step in self._steps for name in step[2]]
        runs = [rows for step in self._steps for rows in step[3]]
        slots, runs = torch.tensor(slots, dtype=torch.long), torch.tensor(runs, dtype=torch.long)
        slot_R = slots.repeat_interleave(runs)
        order_R = torch.argsort(slot_R, stable=True)  # within a request, in step order
        positions_R, ids_RMK = positions_R[order_R], ids_RMK[order_R]
        ends = torch.bincount(slot_R, minlength=len(names)).cumsum(0).tolist()
        for name, first, last in zip(names, [0, *ends[:-1]], ends, strict=True):
            group = (positions_R[first:last], ids_RMK[first:last])
            self._requests.setdefault(name, []).append(group)
        self._steps = []

    def take(self, request_id: str, length: int) -> torch.Tensor:
        """The request's ids [length, M, K] (-1 where not run), forgetting them. A position
        run twice (a request preempted and recomputed) keeps its last run's ids."""
        self._group()
        K = self.routers[0].top_k
        out = torch.full((length, len(self.routers), K), -1, dtype=torch.int16)
        groups = self._requests.pop(request_id, [])
        if not groups:
            return out
        positions = torch.cat([group[0] for group in groups])
        ids = torch.cat([group[1] for group in groups])
        inside = positions < length
        positions, ids = positions[inside], ids[inside]
        order = torch.argsort(positions, stable=True)  # steps in order within a position
        positions, ids = positions[order], ids[order]
        last = torch.ones_like(positions, dtype=torch.bool)
        last[:-1] = positions[1:] != positions[:-1]
        out[positions[last]] = ids[last]
        return out


@functools.lru_cache(maxsize=1 << 16)
def _external(request_id: str) -> str:
    """The id the request was added with: vLLM 0.32 runs it as "{id}-{8 hex digits}" (and
    sample i of an n > 1 request as "{i}_{id}-{8 hex digits}")."""
    match = re.fullmatch(r"(.*)-[0-9a-f]{8}", request_id)
    return match.group(1) if match else request_id
