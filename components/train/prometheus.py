"""Each node's training metrics in Prometheus' text format, on `train.metrics_port` (0 = off).

Every rank records its own values, labelled with the run's identity, its rank and its node;
prometheus_client's multiprocess mode keeps them in files of a node-local directory, and the
node's first local rank serves all of them on one port, so a pod is one scrape target however
many processes it runs. `deploy/monitoring/` has the PodMonitor, the Grafana dashboard and the
alert rules; `METRICS` here is the one list of what is served (a test holds those files to it).
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

# metric name -> (the step record's key, help); gauges, the most recent value of each rank
STEP_GAUGES = {
    "liftoff_train_step": ("step", "the last optimizer step this rank finished"),
    "liftoff_train_loss": ("loss", "the step's loss, averaged over every rank"),
    "liftoff_train_grad_norm": ("grad_norm", "the gradient norm before clipping"),
    "liftoff_train_lr": ("lr", "the learning rate of the step"),
    "liftoff_train_tokens_per_second": ("tokens_per_s", "tokens per second of the whole job, this step"),
    "liftoff_train_mfu": ("mfu", "model FLOPs utilization, 0-1 (absent without a device peak)"),
    "liftoff_train_step_seconds": ("step_s", "wall time of the step"),
    "liftoff_train_forward_seconds": ("forward_s", "this rank's own forward time"),
    "liftoff_train_comm_seconds": ("comm_s", "the step's loss all-reduce, waiting for the slowest rank included"),
    "liftoff_train_data_seconds": ("data_s", "time spent waiting for batches"),
    "liftoff_train_optimizer_seconds": ("optimizer_s", "clip and optimizer step"),
    "liftoff_train_peak_memory_bytes": ("peak_memory_bytes", "peak device memory (CPU: peak resident set)"),
    "liftoff_train_skipped_steps": ("skipped_steps", "steps whose update was dropped (non-finite or a spike)"),
    "liftoff_checkpoint_blocking_seconds": ("checkpoint_blocking_s", "the last save's time on the training thread"),
    "liftoff_checkpoint_background_seconds": ("checkpoint_background_s", "the last seal and publish, off the step"),
    "liftoff_train_last_step_timestamp_seconds": ("time", "unix time the last step finished"),
}
OTHER = {
    "liftoff_train_loss_spikes_total": ("counter", "loss spikes seen (train.loss_spike_factor)"),
    "liftoff_straggler_zscore": ("gauge", "leave-one-out z-score of each rank's forward time (rank 0 reports)"),
    "liftoff_train_planned_steps": ("gauge", "train.steps: the step the run ends at (a stall is short of it)"),
    "liftoff_val_loss": (
        "gauge",
        "periodic validation's loss: source=all the run's val blocks, else a mixture's source",
    ),
}
METRICS = {**{name: "gauge" for name in STEP_GAUGES}, **{name: kind for name, (kind, _) in OTHER.items()}}
LABELS = ("run", "rank", "node")


def node_port(base: int, group_rank: int, nodes_share_host: bool) -> int:
    """The port a node serves on: the same everywhere on a cluster; locally, where every "node"
    is a process tree on one host, base + the node's index."""
    return base + group_rank if nodes_share_host else base


class Exporter:
    """This rank's metrics; `serve()` on the node's first local rank."""

    def __init__(self, run: str, rank: int, node: str, directory: Path):
        from prometheus_client import values

        directory.mkdir(parents=True, exist_ok=True)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(directory)
        values.ValueClass = values.MultiProcessValue()  # whatever imported prometheus_client first
        from prometheus_client import Counter, Gauge

        self.directory, self.labels = directory, {"run": run, "rank": str(rank), "node": node}
        self._gauges = {
            name: Gauge(name, text, LABELS, multiprocess_mode="mostrecent", registry=None)
            for name, (_, text) in STEP_GAUGES.items()
        }
        self._spikes = Counter("liftoff_train_loss_spikes", OTHER["liftoff_train_loss_spikes_total"][1], LABELS,
                               registry=None)  # fmt: skip
        self._z = Gauge("liftoff_straggler_zscore", OTHER["liftoff_straggler_zscore"][1], LABELS,
                        multiprocess_mode="mostrecent", registry=None)  # fmt: skip
        self._planned = Gauge("liftoff_train_planned_steps", OTHER["liftoff_train_planned_steps"][1], LABELS,
                              multiprocess_mode="mostrecent", registry=None)  # fmt: skip
        self._val = Gauge("liftoff_val_loss", OTHER["liftoff_val_loss"][1], (*LABELS, "source"),
                          multiprocess_mode="mostrecent", registry=None)  # fmt: skip
        self._spikes.labels(**self.labels)  # served as 0 from the start, not only after a spike
        self.server = None

    def planned(self, steps: int) -> None:
        self._planned.labels(**self.labels).set(float(steps))

    def serve(self, port: int, addr: str) -> str | None:
        """The URL served, or None where the port cannot be bound (taken on a shared host):
        observability never stops a training, it says so once and the run goes on unscraped."""
        from prometheus_client import CollectorRegistry, multiprocess, start_http_server

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=str(self.directory))
        try:
            self.server, _ = start_http_server(port, addr=addr, registry=registry)
        except OSError as e:
            log.warning("train.metrics_port=%d: cannot serve metrics on %s (%s); training goes on", port, addr, e)
            return None
        return f"http://{addr}:{port}/metrics"

    def step(self, record: dict) -> None:
        for name, (key, _) in STEP_GAUGES.items():
            value = record.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self._gauges[name].labels(**self.labels).set(float(value))

    def val(self, losses: dict[str, float]) -> None:
        """Periodic validation's losses by source (`all`: the run's val blocks)."""
        for source, loss in losses.items():
            self._val.labels(**self.labels, source=source).set(float(loss))

    def spike(self) -> None:
        self._spikes.labels(**self.labels).inc()

    def stragglers(self, z_scores: list[float], hosts: list[str]) -> None:
        for rank, z in enumerate(z_scores):
            labels = {**self.labels, "rank": str(rank), "node": str(hosts[rank])}
            self._z.labels(**labels).set(z if math.isfinite(z) else 0.0)

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


def exporter_for(
    port: int, run: str, rank: int, node: str, launch: str, shares_host: bool, steps: int
) -> Exporter | None:
    """This rank's exporter, serving on the node's first local rank; None with port 0.
    `steps`: train.steps, served from the start (the stall alert tells a finished run from a stalled one)."""
    if port == 0:
        return None
    group_rank = int(os.environ.get("GROUP_RANK", "0"))
    attempt = os.environ.get("LIFTOFF_ATTEMPT", "0")
    directory = Path(tempfile.gettempdir()) / f"liftoff-metrics-{launch}-a{attempt}-node{group_rank}"
    exporter = Exporter(run, rank, node, directory)
    exporter.planned(steps)
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        url = exporter.serve(node_port(port, group_rank, shares_host), "127.0.0.1" if shares_host else "0.0.0.0")
        if url:
            log.info("Prometheus metrics of node %s on %s", node, url)
    return exporter
