"""The train stage: check the inputs, launch the workers with TorchX, publish the model."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import signal
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from components import fleet
from components.config import ClusterConfig, DataConfig, ModelConfig, Scheduler, TrainConfig
from components.identity import mixture_identity, training_identity
from components.launcher import Launch, replica_store, run_app
from components.mixture import draw_weights, max_epochs
from components.prelaunch import check_inputs
from components.store import ArtifactStore, Manifest, Ref
from components.store.lease import Lease, default_holder
from components.train.spec import TrainSpec, WorkerResult

log = logging.getLogger(__name__)

LEASE_TTL_S = 120.0  # a driver lost without releasing its lease (OOM, node failure) blocks reruns this long


@dataclass
class TrainResult:
    identity: str
    run_dir: Path
    model: Manifest
    final_loss: float
    checkpoint_version: str
    result: WorkerResult
    metrics: Path  # the run's metrics.jsonl, as fetched from the store
    hung: list[str] = dataclasses.field(default_factory=list)  # nodes quarantined after a hang, relaunched off


class TrainFailed(RuntimeError):
    """Training ran but what it hands back is not whole."""


class PreflightNotPassed(RuntimeError):
    """Train was handed a preflight verdict that does not say the fleet and plan passed."""


def require_passing_verdict(verdict: dict) -> dict:
    """The verdict preflight hands train, when it says the run may start. KFP never starts
    train after a failed gate; this guards a verdict edited or produced by another path."""
    if verdict.get("passed") is not True:
        unhealthy = "; ".join(f"{n}: {', '.join(r)}" for n, r in verdict.get("unhealthy", {}).items())
        raise PreflightNotPassed(f"preflight did not pass{': ' + unhealthy if unhealthy else ''}; not training")
    return verdict


def train_launch(
    dataset: str,
    model: ModelConfig,
    train: TrainConfig,
    cluster: ClusterConfig,
    store_cfg,
    exclude_nodes=(),
    *,
    cache_gb: float,
    trains_no_step: bool = False,
    mixture: dict | None = None,
    max_epochs: dict | None = None,
) -> tuple[str, Path, Launch]:
    """(training identity, run directory, the TorchX job that trains it). `mixture`: a mixture's
    normalised weights per source, `max_epochs` its caps (`components.mixture`)."""
    identity = training_identity(dataset, model, train, mixture_identity(mixture or {}, max_epochs or {}))
    run_dir = Path(train.run_dir).resolve() / identity
    # paths inside a replica, relative to its own working directory (a pod's home; locally its
    # node directory): no replica writes where the driver or another node could read it
    ckpt_dir = Path(train.checkpoint_dir) if train.checkpoint_dir else Path("checkpoints")
    spec = TrainSpec(
        train=train,
        model=model,
        store=replica_store(store_cfg, cluster),
        dataset=dataset,
        data_cache_gb=cache_gb,
        identity=identity,
        launch_id=f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}",
        run_dir="run",
        checkpoint_dir=str(ckpt_dir / identity),
        nodes_share_host=cluster.scheduler == Scheduler.local_cwd,
        quarantine_ttl_s=cluster.quarantine_ttl_h * 3600,
        trains_no_step=trains_no_step,
        mixture=dict(mixture or {}),
        max_epochs=dict(max_epochs or {}),
    )
    name = f"train-{identity[:8]}"
    launch = Launch("components.train.worker", spec, cluster, name, run_dir / "logs", run_dir / "nodes", exclude_nodes)
    launch.metrics_port = train.metrics_port
    return identity, run_dir, launch


def quarantine_hung(store: ArtifactStore, culprit: dict | None, ttl_h: float) -> list[str]:
    """After a failed attempt that hung: the node of the rank its peers waited for (its own
    report) is quarantined, so the next attempt and the next launch keep off it; the nodes."""
    if culprit is None or ttl_h <= 0 or not isinstance(culprit.get("node"), str):
        return []
    c = culprit["collective"]
    reason = (
        f"hang: rank {culprit['rank']} behind in {c['op']} #{c['seq']} ({c['name']}, step {c['step']}), {c['phase']}"
    )
    fleet.quarantine(store, culprit["node"], "hang", reason, ttl_h * 3600, culprit)
    log.warning("quarantined node %s: %s", culprit["node"], reason)
    return [culprit["node"]]


def run_train(
    dataset: str,
    model: ModelConfig,
    train: TrainConfig,
    cluster: ClusterConfig,
    store_cfg,
    store: ArtifactStore,
    exclude_nodes: list[str] | tuple[str, ...] = (),
    *,
    cache_gb: float,
    trains_no_step: bool = False,
    data: DataConfig | None = None,
) -> TrainResult:
    """Train on the cluster's nodes except `exclude_nodes` (preflight's verdict). `data`: the
    data group, whose mixture weights the sampler draws a mixture's sources by."""
    data_manifest = store.resolve(*_kind_name_version(dataset))
    check_inputs(data_manifest, model, train, cluster, store, cache_gb, data=data)
    weights = draw_weights(data, data_manifest) if data is not None else {}
    identity, run_dir, launch = train_launch(
        str(data_manifest.ref),
        model,
        train,
        cluster,
        store_cfg,
        exclude_nodes,
        cache_gb=cache_gb,
        trains_no_step=trains_no_step,
        mixture=weights,
        max_epochs=max_epochs(data) if data is not None else {},
    )
    log.info("training identity %s: run directory %s", identity, run_dir)
    launch.quarantined = lambda: fleet.quarantined(store)  # each attempt keeps off the nodes quarantined by then
    hung: list[str] = []  # one hang quarantines one node: a stall that follows a rank is a bug, not a node
    launch.after_failure = lambda e: hung or hung.extend(quarantine_hung(store, e.hung, cluster.quarantine_ttl_h))
    # one run per training identity per store: a second one fails at once, naming the holder
    lease = Lease(store, identity, default_holder(launch.spec.launch_id), ttl_s=LEASE_TTL_S)
    with sigterm_exits(), lease.hold():  # a stopped driver releases the lease wherever it is stopped
        try:
            run_app(launch)  # its replicas publish no model once the lease is not this launch's
        finally:
            lease.check()  # a lease lost to another run (it expired in a store outage): its result is not ours
    # the store is the only channel back from the replicas: nothing is read from their disks
    record = store.fetch(store.manifest(Ref("run", identity, launch.spec.launch_id)))
    result = WorkerResult.from_json(json.loads((record / "result.json").read_text()))
    final = Ref("checkpoint", model.name, result.checkpoint_version)
    if not store.exists(final):  # the model's parent must exist, or validate cannot judge it
        why = "; ".join(result.publish_errors) or "it was never committed"
        raise TrainFailed(f"training finished but its final checkpoint {final} is not in {store.description}: {why}")
    manifest = store.manifest(Ref.parse(result.model))
    return TrainResult(
        identity,
        run_dir,
        manifest,
        result.final_loss,
        result.checkpoint_version,
        result,
        record / "metrics.jsonl",
        hung,
    )


@contextlib.contextmanager
def sigterm_exits():
    """SIGTERM (KFP and the kubelet stop a driver pod with it) raises SystemExit in the driver,
    so `finally` blocks run: the lease is released and the job cancelled."""

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, stop) if main else None
    try:
        yield
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)


def _kind_name_version(ref: str) -> tuple[str, str, str]:
    r = Ref.parse(ref)
    return r.kind, r.name, r.version
