"""Training telemetry: JSONL + TensorBoard on rank 0, MFU, stragglers, loss spikes, watchdog."""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import socket
import statistics
import sys
import threading
import time
from collections import deque
from pathlib import Path

import torch
import torch.distributed as dist

from components.robust import leave_one_out_z

log = logging.getLogger(__name__)
WATCHDOG_EXIT_CODE = 75


def mfu(tokens_per_second: float, flops_per_token: float, peak_tflops: float | None, devices: int) -> float | None:
    """Model FLOPs utilization: achieved training FLOP/s over the peak of all devices."""
    if not peak_tflops:
        return None
    return tokens_per_second * flops_per_token / (peak_tflops * 1e12 * devices)


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # CPU: peak resident set


class Monitor:
    def __init__(
        self,
        out_dir: Path,
        rank: int,
        world: int,
        spike_factor: float,
        straggler_z: float,
        tensorboard_interval: int = 1,
    ):
        self.rank, self.world, self.tb_interval = rank, world, tensorboard_interval
        self.spike_factor, self.straggler_z = spike_factor, straggler_z
        self.losses: deque[float] = deque(maxlen=50)
        self.step_times: list[float] = []
        self._jsonl = self._tb = None
        if rank == 0:
            out_dir.mkdir(parents=True, exist_ok=True)
            self._jsonl = open(out_dir / "metrics.jsonl", "a", buffering=1)
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(out_dir / "tensorboard"))
        self.hosts = [None] * world
        dist.all_gather_object(self.hosts, socket.gethostname())

    def log_step(self, record: dict) -> None:
        # Forward time is this rank's own: under DDP no collective runs in forward, whereas
        # backward and the optimizer include waiting for the slowest rank, which would make
        # every fast rank look slow.
        self.step_times.append(record["forward_s"])
        if record.get("loss") is not None and record["stepped"]:
            if len(self.losses) >= 10 and record["loss"] > self.spike_factor * statistics.median(self.losses):
                self.event(
                    "loss_spike",
                    step=record["step"],
                    loss=record["loss"],
                    running_median=statistics.median(self.losses),
                    factor=self.spike_factor,
                )
            self.losses.append(record["loss"])
        if self.rank != 0:
            return
        self._jsonl.write(json.dumps({"kind": "step", **record}) + "\n")
        if record["step"] % self.tb_interval:
            return
        for key, value in record.items():
            if isinstance(value, (int, float)) and key not in ("step", "time") and value is not None:
                self._tb.add_scalar(f"train/{key}", value, record["step"])

    def event(self, kind: str, **fields) -> None:
        log.warning("event %s: %s", kind, json.dumps(fields))
        if self.rank == 0:
            self._jsonl.write(json.dumps({"kind": kind, **fields}) + "\n")

    def check_stragglers(self, step: int) -> list[int]:
        """Gather each rank's mean forward time since the last check; report the slow outliers."""
        mine = torch.tensor([statistics.fmean(self.step_times) if self.step_times else 0.0], dtype=torch.float64)
        self.step_times.clear()
        gathered = [torch.zeros_like(mine) for _ in range(self.world)]
        dist.all_gather(gathered, mine)
        times = [float(t) for t in gathered]
        slow = [r for r, z in enumerate(leave_one_out_z(times)) if z > self.straggler_z]
        for r in slow:
            self.event(
                "straggler",
                step=step,
                rank=r,
                host=self.hosts[r],
                forward_s=times[r],
                median_others_s=statistics.median(times[:r] + times[r + 1 :]),
            )
        return slow

    def close(self) -> None:
        if self.rank == 0:
            self._jsonl.close()
            self._tb.close()


class Watchdog(threading.Thread):
    """No step progress for `timeout_s`: dump every thread's stack and exit non-zero, so the
    launcher restarts the job instead of it hanging until the cluster's timeout."""

    def __init__(self, timeout_s: float):
        super().__init__(name="watchdog", daemon=True)
        self.timeout_s = timeout_s
        self._last = time.monotonic()
        self._stopped = threading.Event()

    def beat(self) -> None:
        self._last = time.monotonic()

    def stop(self) -> None:
        self._stopped.set()

    def run(self) -> None:
        while not self._stopped.wait(min(1.0, self.timeout_s / 4)):
            idle = time.monotonic() - self._last
            if idle > self.timeout_s:
                print(
                    f"watchdog: no training progress for {idle:.0f}s (train.watchdog_timeout_s="
                    f"{self.timeout_s}); stacks of all threads follow",
                    file=sys.stderr,
                    flush=True,
                )
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                sys.stderr.flush()
                os._exit(WATCHDOG_EXIT_CODE)
