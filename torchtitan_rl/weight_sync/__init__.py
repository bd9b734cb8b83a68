"""Weight sync: the trainer's weights into the generator's, every step, with no file and no
reload. One rule for what is sent and how it is checked, and one interface, `Transport`
(base.py); a transport per placement: the in-place copy within a process (local.py,
colocated) and the broadcast from the trainer ranks to the generator ranks (broadcast.py,
disaggregated).

    .venv/bin/python -m pytest tests/unit/test_weight_sync.py tests/integration/test_weight_sync.py

A new transport is one file: a class with the `Transport` methods and a `build(config,
trainer, peer)`, named in TRANSPORTS under the placement (generator.placement) that uses it.
"""

from torchtitan_rl.weight_sync.base import SyncStats, Transport, WeightSyncError
from torchtitan_rl.weight_sync.broadcast import BroadcastSender
from torchtitan_rl.weight_sync.local import LocalTransport, WeightSync

TRANSPORTS = {
    "colocated": LocalTransport,
    "disaggregated": BroadcastSender,
    "continuous": BroadcastSender,
}
"""The transport of each placement (generator.placement)."""


def transport(config, trainer, peer) -> Transport:
    """The run's transport from `trainer` (a PolicyTrainer), by its placement. `peer` is what
    the transport reaches the generators through: the LocalGenerator of this process (colocated),
    or the run's Topology (disaggregated)."""
    return TRANSPORTS[config.generator.placement].build(config, trainer, peer)


__all__ = [
    "TRANSPORTS",
    "LocalTransport",
    "SyncStats",
    "Transport",
    "WeightSync",
    "WeightSyncError",
    "transport",
]
