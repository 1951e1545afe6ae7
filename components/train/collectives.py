"""liftoff's own collectives, counted, so a hang can be localised. Every rank runs the same
collectives in the same order, each numbered by a sequence number; the tracker knows which one
a rank is in and whether it has reached the backend (waiting for its peers) or not (stuck
before it: in its own work). Every failure report of a rank carries that state (its
`rank_failed` event), from which the driver names the rank that is behind
(components/failures.py); a watchdog timeout also leaves it in the store
(`_hangs/<launch id>-a<attempt>/rank<r>.json`), the evidence that outlives the pods. gloo has no flight recorder
(NCCL's `TORCH_NCCL_TRACE_BUFFER_SIZE` is the GPU counterpart); DDP's own gradient buckets
are not counted here."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

from components.failures import DONE, ENTERED, WAITING

HANGS = "_hangs"


@dataclass
class Collective:
    seq: int  # the how-manieth of this rank's collectives
    op: str  # all_reduce, all_gather, ...
    name: str  # what it carries: "loss", "straggler times"
    step: int
    phase: str  # entered (not yet in the backend), waiting (in the backend, for the peers), done
    since: float  # unix time it entered


class Tracker:
    def __init__(self):
        self.seq = 0
        self.current: Collective | None = None
        self.last: Collective | None = None
        self.before_backend: list[Callable[[Collective], None]] = []  # test seams (fault injection)

    @contextlib.contextmanager
    def collective(self, op: str, name: str, step: int) -> Iterator[Collective]:
        """Around one collective call: `with tracker.collective("all_reduce", "loss", step): ...`."""
        self.seq += 1
        c = Collective(self.seq, op, name, step, ENTERED, time.time())
        self.current = c
        for hook in self.before_backend:
            hook(c)
        c.phase = WAITING
        yield c
        c.phase, self.current, self.last = DONE, None, c

    def state(self) -> dict | None:
        """Where this rank is: the collective it is in, else the last one it finished."""
        c = self.current or self.last
        return asdict(c) if c is not None else None


def hand_back_hang(store, launch_id: str, attempt: int, rank: int, record: dict) -> None:
    """A hung rank's report in the store, where the driver reads it."""
    store.backend.put_bytes(f"{HANGS}/{launch_id}-a{attempt}/rank{rank}.json", json.dumps(record).encode())
