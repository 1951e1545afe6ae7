"""What a run-time finding does: a loss spike or a non-finite step is looked at before the
optimizer steps, and `train.on_spike` / `train.on_nonfinite` (off | log | skip | rollback |
halt, components/config/schema.py's `Guard`) decide whether its update is applied, whether the
run rewinds to a checkpoint and whether the stage fails.

Every rank holds the same all-reduced loss and the same recent losses (checkpointed), so every
rank takes the same decision without a collective of its own. A spike rollback rewinds the
step, the data position and the history to the newest checkpoint before the first spike of
the row, and the samples those spiking steps read are skipped from then on: the windows are
kept in every checkpoint after and listed in the model's metadata (`skipped_samples`), so the
run stays reproducible and says what it never trained on.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from components.config import Guard, TrainConfig

RECENT = 50  # the running median's window of stepped losses


class GuardHalt(RuntimeError):
    """A finding whose guard is `halt` (or a rollback with nothing to roll back to)."""


@dataclass
class Finding:
    kind: str  # "spike" | "nonfinite"
    apply: bool  # whether the step's update still reaches the optimizer
    median: float | None = None  # the running median a spike was judged against


class Guards:
    def __init__(self, train: TrainConfig):
        self.train = train
        self.losses: deque[float] = deque(maxlen=RECENT)  # stepped losses, as every rank saw them

    def judge(self, loss: float) -> Finding | None:
        """The step's finding, from its all-reduced loss, before the optimizer sees it."""
        t = self.train
        if not math.isfinite(loss):
            if t.on_nonfinite == Guard.off:
                return None
            return Finding("nonfinite", apply=t.on_nonfinite == Guard.log)
        if t.on_spike == Guard.off or len(self.losses) < 10:
            return None
        median = statistics.median(self.losses)
        if loss > t.loss_spike_factor * median:
            return Finding("spike", apply=t.on_spike == Guard.log, median=median)
        return None

    def stepped(self, loss: float, spike: bool) -> None:
        """A loss the run went on with. A spike joins the median under `log` and `skip` (a loss
        level that moves for good stops being a spike), never where it may be rewound."""
        if not spike or self.train.on_spike in (Guard.log, Guard.skip):
            self.losses.append(loss)

    def holds_checkpoints(self, spikes_in_row: int) -> bool:
        """No checkpoint inside a row of spikes that a rollback or halt may still act on: a save
        there would be a version the rewind skips (and a relaunch could resume)."""
        return spikes_in_row > 0 and self.train.on_spike in (Guard.rollback, Guard.halt)

    def state(self) -> list[float]:
        return list(self.losses)

    def restore(self, losses: list[float] | None) -> None:
        self.losses = deque(losses or [], maxlen=RECENT)

    def spike_action(self, in_row: int) -> Guard | None:
        """After a spiking step: the rollback or halt once more than `train.max_spikes` in a row spiked."""
        t = self.train
        if t.on_spike in (Guard.rollback, Guard.halt) and in_row > t.max_spikes:
            return t.on_spike
        return None

    def nonfinite_action(self, in_row: int) -> Guard | None:
        t = self.train
        if t.on_nonfinite == Guard.halt:
            return Guard.halt
        if t.on_nonfinite == Guard.rollback and in_row >= t.max_bad_steps:
            return Guard.rollback
        return None


def past_skipped(sample: int, span: int, windows: list[list[int]]) -> int:
    """The first global sample at or after `sample` where a micro-batch of `span` samples
    overlaps no skipped [start, end) window (on another world size a micro-batch can straddle
    a window's edge)."""
    moved = True
    while moved:
        moved = False
        for start, end in windows:
            if sample < end and start < sample + span:
                sample, moved = end, True
    return sample


def add_window(windows: list[list[int]], start: int, end: int) -> list[list[int]]:
    """The skipped windows with [start, end) added, overlapping ones merged, in order."""
    merged: list[list[int]] = []
    for s, e in sorted([*windows, [start, end]]):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return merged
