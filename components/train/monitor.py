"""Training telemetry on rank 0: JSONL and TensorBoard (one event file per run), val loss, MFU,
stragglers, watchdog (loss spikes: components/train/guards.py)."""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import shutil
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from components.devices import peak_tflops
from components.model_math import host_memory_bytes, mfu
from components.plots import read_timeline
from components.robust import leave_one_out_z
from components.worker_side import report_failure

log = logging.getLogger(__name__)
WATCHDOG_EXIT_CODE = 75


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # CPU: peak resident set


def device_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return host_memory_bytes()


def device_peak_tflops(device: torch.device) -> float | None:
    """The device's dense bf16 peak from its name; None on CPU (MFU is then omitted)."""
    if device.type != "cuda":
        return None
    return peak_tflops(torch.cuda.get_device_name(device))


class DeviceTimer:
    """Accumulates the time of the `with` blocks it wraps. On a GPU it records CUDA events
    and reads them only when asked (after the step's own sync), so timing adds no sync."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._spans: list = []
        self._cpu_s = 0.0

    def __enter__(self):
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self._spans.append([start, None])
        else:
            self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._spans[-1][1] = end
        else:
            self._cpu_s += time.perf_counter() - self._t0

    def seconds(self) -> float:
        if self.cuda:
            return sum(s.elapsed_time(e) for s, e in self._spans) / 1e3
        return self._cpu_s


class StepLine:
    """torchtitan's step line: loss, tokens/s averaged over the log interval, MFU, peak memory
    (GiB and % of the device), step time and ETA."""

    def __init__(
        self,
        steps: int,
        interval: int,
        flops_per_token: float,
        peak: float | None,
        world: int,
        device: torch.device,
    ):
        self.steps, self.interval, self.flops_per_token = steps, interval, flops_per_token
        self.peak, self.world = peak, world
        self.device_bytes = device_memory_bytes(device)
        self._window: list[dict] = []

    def mfu(self, tokens_per_s: float) -> float | None:
        return mfu(tokens_per_s, self.flops_per_token, self.peak, self.world)

    def add(self, record: dict) -> dict | None:
        """The step's figures to log (averaged over the log interval), or None between intervals:
        what rank 0 logs as its step line and hands the driver as a `step` event."""
        self._window.append(record)
        step = record["step"]
        if step % self.interval and step != self.steps:
            return None
        window, self._window = self._window, []
        seconds = sum(r["step_s"] for r in window)
        tps = sum(r["tokens_per_s"] * r["step_s"] for r in window) / seconds
        step_s = seconds / len(window)
        mem = record["peak_memory_bytes"]
        return {
            "step": step,
            "steps": self.steps,
            **{k: float(record[k]) for k in ("loss", "grad_norm", "lr")},
            "tokens_per_s": tps,
            "mfu": self.mfu(tps),
            "peak_memory_gib": mem / 2**30,
            "memory_fraction": mem / self.device_bytes,
            "step_s": step_s,
            "eta_s": step_s * (self.steps - step),
        }


def step_text(f: dict) -> str:
    """The step line of the log, from `StepLine.add`'s figures."""
    parts = [
        f"step {f['step']}/{f['steps']}",
        f"loss {f['loss']:.4f}",
        f"grad_norm {f['grad_norm']:.3f}",
        f"lr {f['lr']:.2e}",
        f"{f['tokens_per_s']:,.0f} tokens/s",
    ]
    parts += [f"MFU {f['mfu']:.1%}"] if f["mfu"] is not None else []
    parts += [
        f"mem {f['peak_memory_gib']:.2f} GiB ({f['memory_fraction']:.0%})",
        f"step {f['step_s']:.3f}s",
        f"ETA {duration(f['eta_s'])}",
    ]
    return "  ".join(parts)


def duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}"


class Monitor:
    def __init__(
        self,
        out_dir: Path,
        rank: int,
        world: int,
        straggler_z: float,
        tensorboard_interval: int = 1,
        device: torch.device | None = None,
        exporter=None,
    ):
        self.rank, self.world, self.tb_interval = rank, world, tensorboard_interval
        self.device = device or torch.device("cpu")  # NCCL collectives need device tensors
        self.straggler_z = straggler_z
        self.step_times: list[float] = []
        self.out_dir = out_dir
        self.exporter = exporter  # components/train/prometheus.py, with train.metrics_port
        self._jsonl = self._tb = None
        if rank == 0:
            out_dir.mkdir(parents=True, exist_ok=True)
            self._jsonl = open(self.history, "a", buffering=1)
        self.last_z: list[float] = []  # each rank's straggler z-score at the last check
        self.hosts = [None] * world
        dist.all_gather_object(self.hosts, os.environ.get("NODE_NAME") or socket.gethostname())

    def log_step(self, record: dict) -> None:
        # Forward time is this rank's own: under DDP no collective runs in forward, whereas
        # backward and the optimizer include waiting for the slowest rank, which would make
        # every fast rank look slow.
        self.step_times.append(record["forward_s"])
        if self.exporter is not None:
            self.exporter.step(record)
        if self.rank != 0:
            return
        if self._tb is None:  # the run's first step here: steps before it are the run's history
            self.open_tensorboard(record["step"] - 1)
        self._jsonl.write(json.dumps({"kind": "step", **record}) + "\n")
        self._tb_step(record)

    def log_val(self, step: int, loss: float, blocks: int, seconds: float, sources: dict | None = None) -> None:
        """Periodic validation's loss on the fixed held-out blocks (rank 0 records it); a
        mixture's `sources`: each source's loss on its own first val blocks (`val_loss/<source>`)."""
        if self.exporter is not None:
            self.exporter.val({"all": loss, **(sources or {})})
        if self.rank != 0:
            return
        record = {
            "kind": "val",
            "step": step,
            "val_loss": loss,
            "val_blocks": blocks,
            "val_s": seconds,
            "time": time.time(),
            **{f"val_loss/{name}": v for name, v in (sources or {}).items()},
        }
        log.info("step %d  val_loss %.4f  (%d held-out blocks, %.2fs)", step, loss, blocks, seconds)
        self._jsonl.write(json.dumps(record) + "\n")
        self._tb_val(record)

    def open_tensorboard(self, upto_step: int) -> None:
        """One event file per run directory: a rerun (a resume, a relaunch) replaces the event
        files there with one that replays metrics.jsonl's timeline up to `upto_step` (the step it
        resumes from), then goes on with the steps it trains; TensorBoard never sees a step twice."""
        from torch.utils.tensorboard import SummaryWriter

        tb_dir = self.out_dir / "tensorboard"
        for old in tb_dir.glob("events.out.tfevents.*"):
            old.unlink()
        self._tb = SummaryWriter(str(tb_dir))
        steps, vals = read_timeline(self.out_dir / "metrics.jsonl")
        for rec in sorted(steps + vals, key=lambda r: (r["step"], r["kind"] == "val")):
            if rec["step"] <= upto_step:
                (self._tb_step if rec["kind"] == "step" else self._tb_val)(rec)

    def _tb_step(self, record: dict) -> None:
        if record["step"] % self.tb_interval:
            return
        for key, value in record.items():
            if isinstance(value, (int, float)) and key not in ("step", "time", "kind") and value is not None:
                self._tb.add_scalar(f"train/{key}", value, record["step"], walltime=record.get("time"))

    def _tb_val(self, record: dict) -> None:
        self._tb.add_scalar("val/loss", record["val_loss"], record["step"], walltime=record.get("time"))
        for key in (k for k in record if k.startswith("val_loss/")):  # a mixture's sources
            self._tb.add_scalar(f"val/loss/{key[9:]}", record[key], record["step"], walltime=record.get("time"))

    def event(self, kind: str, **fields) -> None:
        routine = kind in ("start", "end")  # the run's bookends are records, not warnings
        log.log(logging.INFO if routine else logging.WARNING, "event %s: %s", kind, json.dumps(fields))
        if self.rank == 0:
            self._jsonl.write(json.dumps({"kind": kind, **fields}) + "\n")

    def check_stragglers(self, step: int) -> list[int]:
        """Gather each rank's mean forward time since the last check; report the slow outliers."""
        mean = statistics.fmean(self.step_times) if self.step_times else 0.0
        mine = torch.tensor([mean], dtype=torch.float64, device=self.device)
        self.step_times.clear()
        gathered = [torch.zeros_like(mine) for _ in range(self.world)]
        dist.all_gather(gathered, mine)
        times = [float(t) for t in gathered]
        z_scores = leave_one_out_z(times)
        self.last_z = z_scores
        if self.exporter is not None and self.rank == 0:
            self.exporter.stragglers(z_scores, self.hosts)
        slow = [r for r, z in enumerate(z_scores) if z > self.straggler_z]
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

    @property
    def history(self) -> Path:
        return self.out_dir / "metrics.jsonl"

    def restore_history(self, saved: Path) -> None:
        """Rank 0, resuming: the run's records up to the checkpoint replace this node's (a new
        pod has none; a relaunch's include steps the resume trains again)."""
        if self.rank != 0 or not saved.is_file():
            return
        self._jsonl.close()
        shutil.copyfile(saved, self.history)
        self._jsonl = open(self.history, "a", buffering=1)
        if self._tb is not None:  # a rewind: the event file is rebuilt from the restored timeline
            self._tb.close()
            self._tb = None

    def close(self) -> None:
        if self.exporter is not None:
            self.exporter.close()
        if self.rank == 0:
            self._jsonl.close()
            if self._tb is not None:
                self._tb.close()


class Watchdog(threading.Thread):
    """No step progress for `timeout_s`: dump every thread's stack and exit non-zero, so the
    launcher restarts the job instead of it hanging until the cluster's timeout."""

    def __init__(self, timeout_s: float):
        super().__init__(name="watchdog", daemon=True)
        self.timeout_s = timeout_s
        self._last = time.monotonic()
        self._stopped = threading.Event()
        self.hand_back: Callable[[dict], None] | None = None  # the report to the store, before the exit

    def beat(self) -> None:
        self._last = time.monotonic()

    def stop(self) -> None:
        self._stopped.set()

    def run(self) -> None:
        while not self._stopped.wait(min(1.0, self.timeout_s / 4)):
            idle = time.monotonic() - self._last
            if idle > self.timeout_s:
                said = f"no training progress for {idle:.0f}s (train.watchdog_timeout_s={self.timeout_s})"
                # first, with its time: the peers it fails come after
                try:
                    record = report_failure("WatchdogTimeout", said, stacks_follow=True)
                    self._hand_back(record)
                    print(f"watchdog: {said}; stacks of all threads follow", file=sys.stderr, flush=True)
                    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                    sys.stderr.flush()
                finally:  # whatever the report and the dump do, the process ends: a hung one never would
                    os._exit(WATCHDOG_EXIT_CODE)

    def _hand_back(self, record: dict, wait_s: float = 15.0) -> None:
        """The report to the store, waited for at most `wait_s` (a store outage must not hold the exit)."""
        if self.hand_back is None or not record:
            return

        def send() -> None:
            try:
                self.hand_back(record)
            except Exception as e:
                print(f"watchdog: the hang report did not reach the store: {e}", file=sys.stderr, flush=True)

        sender = threading.Thread(target=send, name="watchdog-hand-back", daemon=True)
        sender.start()
        sender.join(wait_s)
