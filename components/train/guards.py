"""What a run-time finding does: a loss spike or a non-finite step is looked at before the
optimizer steps, and `train.on_spike` / `train.on_nonfinite` (off | log | skip | rollback |
halt, components/config/schema.py's `Guard`) decide whether its update is applied, whether the
run rewinds to a checkpoint and whether the stage fails.

Every rank holds the same all-reduced loss and the same recent losses (checkpointed), so every
rank takes the same decision without a collective of its own. The decision is taken on the
device (`decide`: the median of a device ring of the recent losses, a masked optimizer step), so
a step reads nothing back to the host; the host learns each step's finding when the loop
settles its steps (at log, check and checkpoint steps) and acts on it then: the events, a
rollback or a halt, at most `train.log_interval` steps late. A spike rollback rewinds the
step, the data position and the history to the newest checkpoint before the first spike of
the row, and the samples those spiking steps read are skipped from then on: the windows are
kept in every checkpoint after and listed in the model's metadata (`skipped_samples`), so the
run stays reproducible and says what it never trained on.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import torch

from components.config import Guard, TrainConfig

RECENT = 50  # the running median's window of stepped losses


class GuardHalt(RuntimeError):
    """A finding whose guard is `halt` (or a rollback with nothing to roll back to)."""


@dataclass
class Decision:
    """One step's guard decision, as device tensors (nothing read back)."""

    spike: torch.Tensor  # bool: over loss_spike_factor x the running median
    passed: torch.Tensor  # bool: the guards let the update through (its norm is the step's grad norm)
    stepped: torch.Tensor  # bool: passed and every gradient finite: the optimizer applied it
    median: torch.Tensor  # float64: the running median judged against (NaN before any loss)


class Guards:
    def __init__(self, train: TrainConfig, device: torch.device | None = None):
        self.train = train
        self.losses: deque[float] = deque(maxlen=RECENT)  # stepped losses, as every rank saw them
        self.device = device or torch.device("cpu")
        self._ring: torch.Tensor | None = None  # the losses on the device, NaN where none yet
        self._count: torch.Tensor | None = None  # how many joined (the next slot: count % RECENT)

    def _device_ring(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._ring is None:  # from the host's list: after a start, a resume or a rollback
            ring = torch.full((RECENT,), math.nan, dtype=torch.float64)
            ring[: len(self.losses)] = torch.tensor(list(self.losses), dtype=torch.float64)
            self._ring = ring.to(self.device)
            self._count = torch.tensor(len(self.losses), device=self.device)
        return self._ring, self._count

    def decide(self, loss: torch.Tensor, norm: torch.Tensor) -> Decision:
        """The step's finding, on the device, from its all-reduced loss (float64) and its
        gradients' norm: a non-finite loss (let through under on_nonfinite off and log), a
        spike (over loss_spike_factor x the median of the recent losses, once there are 10; let
        through under on_spike log), and whether the optimizer applies it (let through, every
        gradient finite)."""
        t = self.train
        ring, count = self._device_ring()
        finite = torch.isfinite(loss)
        median = torch.nanquantile(ring, 0.5)  # statistics.median's: the two middles' mean
        spike = finite & (count >= 10) & (loss > t.loss_spike_factor * median)
        if t.on_spike == Guard.off:
            spike = torch.zeros_like(finite)
        passed = finite | (t.on_nonfinite in (Guard.off, Guard.log))
        if t.on_spike != Guard.log:
            passed = passed & ~spike
        return Decision(spike, passed, passed & torch.isfinite(norm), median)

    def join(self, loss: torch.Tensor, d: Decision) -> None:
        """`stepped` on the device: the loss joins the ring where the host's list takes it."""
        ring, count = self._device_ring()
        join = torch.isfinite(loss) & (d.stepped | d.spike)
        if self.train.on_spike not in (Guard.log, Guard.skip):
            join = join & ~d.spike
        slot = (count % RECENT).view(1)
        ring.index_copy_(0, slot, torch.where(join, loss, ring.index_select(0, slot)[0]).view(1))
        count += join.long()

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
        self._ring = self._count = None  # the device's follows

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
