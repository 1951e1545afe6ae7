"""Each DDP rank's gradient norm before the reduction, measured on the steps an SDC check runs
(components/train/sdc.py judges it)."""

from __future__ import annotations

import torch
import torch.distributed as dist


class LocalGradNorms:
    """Each rank's gradient norm before the reduction, on the steps a check runs (`armed`):
    a DDP comm hook sums the squares of every bucket, then all-reduces it as DDP's own would."""

    def __init__(self, model: torch.nn.Module | None, world: int = 1):
        self.armed, self._sq, self.world = False, None, world
        self.installed = hasattr(model, "register_comm_hook")  # DDP; FSDP and one process have no replicas
        if self.installed:
            model.register_comm_hook(None, self._hook)

    def _hook(self, state, bucket):
        """DDP's own reduction, as its reducer does it without a hook (times 1/world, then a
        sum), so the numerics are the same bits with or without the check."""
        buffer = bucket.buffer()
        if self.armed:
            sq = buffer.detach().square().sum(dtype=torch.float64)
            self._sq = sq if self._sq is None else self._sq + sq
        buffer.mul_(1.0 / self.world)
        future = dist.all_reduce(buffer, async_op=True).get_future()
        return future.then(lambda f: f.value()[0])

    def arm(self, armed: bool) -> None:
        """Measure (or not) the next step's backward."""
        self.armed, self._sq = armed, None

    def take(self) -> float:
        """The armed step's local norm (-1 when none was measured), and disarm."""
        sq, self._sq, self.armed = self._sq, None, False
        return float(sq.sqrt()) if sq is not None else -1.0
