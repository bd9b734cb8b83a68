"""Weight sync: the trainer's weights into the generator's, every step, with no file and no
reload. One rule for what is sent and how it is checked (base.py), two transports: the
in-place copy within a process (local.py, colocated) and the broadcast from the trainer ranks
to the generator ranks (broadcast.py, disaggregated).

    .venv/bin/python -m pytest tests/unit/test_weight_sync.py tests/integration/test_weight_sync.py
"""

from torchtitan_rl.weight_sync.base import SyncStats, WeightSyncError
from torchtitan_rl.weight_sync.local import WeightSync

__all__ = ["SyncStats", "WeightSync", "WeightSyncError"]
