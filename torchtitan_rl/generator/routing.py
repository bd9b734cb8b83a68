"""The experts the generator routed each token to, by request: what the trainer compares its
own routing with (`moe/routing_mismatch`) and replays (`algorithm.router_replay`).

    .venv/bin/python -m pytest tests/integration/test_moe.py

vLLM 0.32 returns routed experts (`enable_return_routed_experts`) only from its GPU model
runner; its CPU runner has no capture. So the wrapper captures them itself: each router of the
torchtitan model hands its top-k ids to `RoutingLog.record`; after each engine step's forward,
`commit` files the step's rows under their requests, using the step's attention metadata
(where each request's rows start) and the model runner's batch (which request each is). A
request's routing is then one [T, M, K] tensor (M: the MoE layers), -1 at the positions this
engine did not run: the last token (sampled, never fed back) and prompt blocks served from the
prefix cache.
"""

import re

import torch
from torch.distributed.tensor import DTensor


class RoutingLog:
    """Per request id, the expert ids of the positions the engine ran."""

    def __init__(self, routers: list):
        self.routers = routers
        self.runner = None
        """vLLM's model runner, whose `input_batch` lists the step's requests in row order
        (bound by `LocalGenerator` once the engine exists)."""
        self._step: list[torch.Tensor] = []
        self._requests: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for router in routers:
            router.record = self._step.append

    def commit(self, positions_T: torch.Tensor, query_start_loc: torch.Tensor | None) -> None:
        """File this forward's recorded ids under the requests its rows belong to (a dummy
        forward, without metadata or runner, files nothing)."""
        step, self._step[:] = list(self._step), []
        if query_start_loc is None or self.runner is None or not step:
            return
        # Under generator TP a router's ids are a DTensor (every rank routes every token).
        whole = [ids.full_tensor() if isinstance(ids, DTensor) else ids for ids in step]
        ids_TMK = torch.stack([ids_1TK[0] for ids_1TK in whole], dim=1).to(torch.int16).cpu()
        starts = query_start_loc.tolist()
        request_ids = self.runner.input_batch.req_ids
        positions = positions_T.to("cpu", copy=True)  # vLLM reuses its buffer every step
        for i in range(len(starts) - 1):
            first, last = starts[i], starts[i + 1]
            if last > first:
                self._requests.setdefault(_external(request_ids[i]), []).append(
                    (positions[first:last], ids_TMK[first:last])
                )

    def take(self, request_id: str, length: int) -> torch.Tensor:
        """The request's ids [length, M, K] (-1 where not run), forgetting them."""
        K = self.routers[0].top_k
        out = torch.full((length, len(self.routers), K), -1, dtype=torch.int16)
        for positions, ids in self._requests.pop(request_id, []):
            inside = positions < length
            out[positions[inside]] = ids[inside]
        return out


def _external(request_id: str) -> str:
    """The id the request was added with: vLLM 0.32 runs it as "{id}-{8 hex digits}" (and
    sample i of an n > 1 request as "{i}_{id}-{8 hex digits}")."""
    match = re.fullmatch(r"(.*)-[0-9a-f]{8}", request_id)
    return match.group(1) if match else request_id
