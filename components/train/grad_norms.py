"""Each DDP rank's gradient norm before the reduction, measured on the steps an SDC check runs
(components/train/sdc.py judges it)."""

from __future__ import annotations

import torch


class LocalGradNorms:
    """Each rank's gradient norm before the reduction, on the steps a check runs (`armed`):
    a DDP comm hook sums the squares of every bucket, then all-reduces it as DDP's own would."""

    def __init__(self, model: torch.nn.Module):
        self.armed, self._sq = False, None
        if hasattr(model, "register_comm_hook"):  # DDP; FSDP and one process have no replicas
            model.register_comm_hook(None, self._hook)
            self.installed = True
        else:
            self.installed = False

    def _hook(self, state, bucket):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        if self.armed:
            sq = bucket.buffer().detach().double().square().sum()
            self._sq = sq if self._sq is None else self._sq + sq
        return allreduce_hook(None, bucket)

    def arm(self, armed: bool) -> None:
        """Measure (or not) the next step's backward."""
        self.armed, self._sq = armed, None

    def take(self) -> float:
        """The armed step's local norm (-1 when none was measured), and disarm."""
        sq, self._sq, self.armed = self._sq, None, False
        return float(sq.sqrt()) if sq is not None else -1.0
