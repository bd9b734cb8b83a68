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
        self._requests: dict[str, list[tuple[tuple, int, int]]] = {}
        """Per request, ((positions_T, ids_TMK) of a step, first row, last row) of its steps."""
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
        ids_TMK = ids_TMK.to("cpu", torch.int16)
        starts = metadata.query_start_loc.tolist()
        request_ids = self.runner.input_batch.req_ids
        step = (positions_T.to("cpu", copy=True), ids_TMK)  # vLLM reuses its buffer every step
        # Only where each request's rows are: the slicing waits for `take` (per request and
        # step, it was a fifth of a tiny MoE engine's time).
        for i in range(len(starts) - 1):
            first, last = starts[i], starts[i + 1]
            if last > first:
                self._requests.setdefault(_external(request_ids[i]), []).append((step, first, last))

    def take(self, request_id: str, length: int) -> torch.Tensor:
        """The request's ids [length, M, K] (-1 where not run), forgetting them. A position
        run twice (a request preempted and recomputed) keeps its last run's ids."""
        K = self.routers[0].top_k
        out = torch.full((length, len(self.routers), K), -1, dtype=torch.int16)
        chunks = self._requests.pop(request_id, [])
        if not chunks:
            return out
        # One indexing for all of the request's steps (per step, the host work of a long
        # generation was a tenth of the engine's time on a tiny MoE).
        positions = torch.cat([step[0][first:last] for step, first, last in chunks])
        ids = torch.cat([step[1][first:last] for step, first, last in chunks])
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
