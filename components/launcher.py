"""TorchX launch, shared by train and preflight: `dist.torchrun` with -j NODESxPROCS on
local_cwd or kubernetes (Volcano). The workers' own side of a launch is
`components/worker_side.py`; what a failed job's replica logs say, `components/failures.py`."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from components import events, fleet, k8s, local_pod
from components.config import ClusterConfig, Scheduler
from components.failures import _reported_failure, describe_failure
from components.worker_side import PLUGIN_ARGS_ENV, PLUGIN_ENV, WorkerSpec

log = logging.getLogger(__name__)

# Warnings the replicas print on every launch with nothing to act on, filtered in the replicas
# (declared in their environment, on Kubernetes as locally): DDP's deprecation of the
# `broadcast_buffers` argument, whose replacement changes what it means (components/parallel/apply.py).
QUIET_WARNINGS = "ignore:`broadcast_buffers` is deprecated:FutureWarning"
# one submission at a time from this process: launches from two threads (two runs, a sweep) both
# reach torchx's `inspect.getsource` -> `ast.parse`, which failed once with "AST constructor
# recursion depth mismatch" when two ran at once
_SUBMITTING = threading.Lock()


class LaunchError(RuntimeError):
    """`summary`: the cause in one line, without the log tail the message quotes under it."""

    def __init__(self, message: str = "", summary: str | None = None, hung: dict | None = None):
        super().__init__(message)
        self.summary = summary or (message.splitlines() or [type(self).__name__])[0]
        self.hung = hung  # a hang's culprit: the report of the rank its peers waited for


@dataclass
class Launch:
    """One TorchX job a stage launches: the worker module and its spec, where, under what name."""

    module: str
    spec: WorkerSpec
    cluster: ClusterConfig
    name: str
    log_dir: Path
    nodes_dir: Path  # locally, replica i lives in nodes_dir/<i>/ (its cwd, HOME, TMPDIR): a pod's own disk
    exclude_nodes: tuple[str, ...] = ()  # nodes the replicas must not run on (quarantined, preflight's verdict)
    # which run this is (the spec's launch or run id, else a new one): on Kubernetes every
    # attempt's vcjob carries it, and a driver deletes only its own launch's earlier attempts
    launch_id: str = ""
    metrics_port: int = 0  # the replicas serve Prometheus metrics there: their pods carry scrape annotations
    quarantined: Callable[[], Iterable[str]] | None = None  # the nodes quarantined now (fleet.py)
    after_failure: Callable[[LaunchError], None] | None = None  # called with each failed attempt's error

    def __post_init__(self):
        spec_id = getattr(self.spec, "launch_id", None) or getattr(self.spec, "run_id", None)
        self.launch_id = self.launch_id or spec_id or f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}"

    @property
    def store_secret(self) -> str | None:
        """The Secret the replicas read the store's keys from (MinIO only)."""
        store = getattr(self.spec, "store", None)
        return store.secret_name if store is not None and store.backend.value == "minio" else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def threads_per_process(cluster: ClusterConfig) -> int:
    """Cores / processes on one host: locally every "node" shares this machine."""
    if cluster.scheduler == Scheduler.local_cwd:
        return max(1, (os.cpu_count() or 1) // (cluster.nodes * cluster.procs_per_node))
    return max(1, cluster.cpu // cluster.procs_per_node)


def replica_store(store_cfg, cluster: ClusterConfig):
    """The store group as the replicas get it. Locally the store directory stands in for
    MinIO, reachable from every node at one absolute path, and each node caches in its own
    directory (an absolute cache_dir would be a disk the nodes share)."""
    from components.config import StoreBackend

    if cluster.scheduler != Scheduler.local_cwd:
        return store_cfg
    root = str(Path(store_cfg.root).resolve()) if store_cfg.backend == StoreBackend.local else store_cfg.root
    return dataclasses.replace(store_cfg, root=root, cache_dir="store-cache")


def plugin_env() -> dict[str, str]:
    """A test's worker plugin (`tests/faults.py`), declared to the replicas like any other env:
    its module, its settings and where it imports from. Empty in production."""
    import importlib.util

    name = os.environ.get(PLUGIN_ENV)
    if not name:
        return {}
    found = importlib.util.find_spec(name.split(".")[0])
    root = Path(next(iter(found.submodule_search_locations or [found.origin]))).parent
    return {PLUGIN_ENV: name, PLUGIN_ARGS_ENV: os.environ.get(PLUGIN_ARGS_ENV, "{}"), "PYTHONPATH": str(root)}


def build_app(
    module: str, spec: WorkerSpec, cluster: ClusterConfig, name: str, env: dict[str, str], nodes_dir=None, exclude=()
):
    """The TorchX AppDef of a launch. Its replicas' environment is exactly what is declared
    here, on Kubernetes as in the local simulation of a pod (`components/local_pod.py`).
    Locally the replicas are the first nodes of this host's fleet that `exclude` leaves."""
    from torchx.components import dist
    from torchx.specs import macros

    port = cluster.rdzv_port or free_port()
    app = dist.torchrun(
        "--spec-b64",
        spec.encode(),
        m=module,
        name=name,
        image=cluster.image,
        j=f"{cluster.nodes}x{cluster.procs_per_node}",
        cpu=cluster.cpu,
        gpu=cluster.gpu,
        memMB=cluster.mem_mb,
        rdzv_port=port,
        env={
            "OMP_NUM_THREADS": str(threads_per_process(cluster)),
            "LOGLEVEL": "WARNING",
            "PYTHONWARNINGS": QUIET_WARNINGS,
            **dict(cluster.env),  # NCCL_* / GLOO_*: declared like every other variable, on every node
            **plugin_env(),
            **env,
        },
    )
    role = app.roles[0]
    if cluster.scheduler == Scheduler.local_cwd:
        role.env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
        role.env["NODE_NAME"] = f"{socket.gethostname()}-node{macros.replica_id}"  # one host, several "nodes"
        names = fleet.local_nodes(socket.gethostname(), cluster.nodes, cluster.spare_nodes, exclude)
        role.env[fleet.NODE_NAMES_ENV] = ",".join(names)  # replica i is node names[i] (worker_side)
        role.env[fleet.REPLICA_ENV] = str(macros.replica_id)
        if nodes_dir is not None:  # each replica in its own directory with only its declared environment
            pod = ["-m", "components.local_pod", "--dir", f"{nodes_dir}/{macros.replica_id}"]
            pod += ["--declared", ",".join(sorted(role.env))]
            secret = Path(nodes_dir) / "secret.json"
            pod += ["--secret", str(secret)] if secret.is_file() else []
            role.args = [*pod, "--", role.entrypoint, *role.args]
            role.entrypoint = sys.executable
    else:  # the Kubernetes node the pod runs on: what preflight records and quarantine patches
        role.env["NODE_NAME"] = k8s.NODE_NAME_FROM_POD
    return app


def scheduler_cfg(cluster: ClusterConfig, log_dir: Path, namespace: str | None = None) -> dict:
    if cluster.scheduler == Scheduler.local_cwd:
        return {"log_dir": str(log_dir)}
    # no server-side dry run: `liftoff render` needs none, and the API server validates the
    # finished job when it is created (k8s.finish_job checks the pod-name limit TorchX would)
    cfg = {"queue": cluster.queue, "namespace": namespace or k8s.namespace(cluster.namespace), "validate_spec": False}
    if cluster.service_account:
        cfg["service_account"] = cluster.service_account
    return cfg


def attempt_of(env: dict[str, str] | None) -> int:
    return int((env or {}).get("LIFTOFF_ATTEMPT", "0"))


def kubernetes_job(
    launch: Launch, env: dict[str, str] | None = None, runner=None, namespace: str | None = None, app=None
):
    """TorchX's own dry run of the job on Kubernetes, finished by `k8s.finish_job`: what a
    cluster run submits and what `liftoff render` writes. Each attempt of each launch is a
    vcjob of its own name, labelled with both, owned by the driver pod when there is one."""
    from torchx.runner import get_runner

    runner = runner or get_runner()
    attempt = attempt_of(env)
    name = k8s.attempt_name(launch.name, launch.launch_id, attempt)
    app = app or build_app(launch.module, launch.spec, launch.cluster, name, env or {})
    ns = namespace or k8s.namespace(launch.cluster.namespace)
    info = runner.dryrun(app, "kubernetes", cfg=scheduler_cfg(launch.cluster, launch.log_dir, ns))
    k8s.finish_job(
        info.request.resource,
        launch.cluster,
        launch.store_secret,
        launch.name,
        launch.exclude_nodes,
        launch_id=launch.launch_id,
        attempt=attempt,
        owner=k8s.driver_owner(ns),
        metrics_port=launch.metrics_port,
    )
    return info


def run_app(launch: Launch, env: dict[str, str] | None = None) -> None:
    """Run the job, relaunching it up to `cluster.max_restarts` times after a failure.

    Restarts are whole-job relaunches (a fresh rendezvous) rather than torchrun's
    --max_restarts: with several elastic agents, one failure can restart each agent a
    different number of times, and their workers then look for each other under different
    store prefixes and never connect. The workers resume from the newest valid checkpoint.
    Each attempt keeps off the nodes quarantined by then (`launch.quarantined`), a record an
    earlier attempt's fault left included.
    """
    attempts = launch.cluster.max_restarts + 1
    for attempt in range(attempts):
        if launch.quarantined is not None:
            launch.exclude_nodes = tuple(sorted({*launch.exclude_nodes, *launch.quarantined()}))
        try:
            return run_once(launch, {**(env or {}), "LIFTOFF_ATTEMPT": str(attempt)})
        except LaunchError as e:
            if launch.after_failure is not None:
                try:
                    launch.after_failure(e)
                except Exception as hook_error:  # the failure matters more than what follows it
                    log.warning("%s: after its failed attempt: %s", launch.name, hook_error)
            if attempt == attempts - 1 or isinstance(e, Unschedulable):  # the same gang would pend again
                raise
            log.warning("%s failed (attempt %d of %d); relaunching: %s", launch.name, attempt + 1, attempts, e.summary)
            events.emit("relaunch", job=launch.name, attempt=attempt + 1, attempts=attempts, cause=e.summary)


def run_once(launch: Launch, env: dict[str, str], tail_lines: int = 40) -> None:
    """Launch, stream every replica's log lines, wait; raise LaunchError with the failing
    replica's last lines when the job does not succeed. The job never outlives this call:
    on a failure, an exception or SIGTERM (a cancelled or evicted driver pod) it is cancelled."""
    from torchx.runner import get_runner

    cluster = launch.cluster
    launch.log_dir.mkdir(parents=True, exist_ok=True)
    runner = get_runner()
    secret = None
    if cluster.scheduler == Scheduler.local_cwd and launch.store_secret:  # what the Secret holds on a cluster
        secret = local_pod.write_secret(launch.nodes_dir / "secret.json", local_pod.store_secret_values(os.environ))
    on_k8s = cluster.scheduler == Scheduler.kubernetes
    name = k8s.attempt_name(launch.name, launch.launch_id, attempt_of(env)) if on_k8s else launch.name
    app = build_app(launch.module, launch.spec, cluster, name, env, launch.nodes_dir, launch.exclude_nodes)
    try:
        if on_k8s:
            namespace = k8s.namespace(cluster.namespace)
            # two jobs must never hold the same GPUs: this launch's earlier attempt, or an orphan
            # whose driver is gone, is deleted; another run's job of the same config never is
            k8s.delete_earlier_attempts(namespace, launch.name, launch.launch_id, attempt_of(env))
            handle = runner.schedule(kubernetes_job(launch, env, runner, namespace, app))
        else:
            with _SUBMITTING:  # torchx parses its options' source on every run; CPython 3.11's ast is not thread-safe
                handle = runner.run(app, scheduler=cluster.scheduler.value, cfg=scheduler_cfg(cluster, launch.log_dir))
        log.info("launched %s on %s: %s", launch.name, cluster.scheduler.value, handle)
        with _cancelled_unless_finished(runner, handle, launch.name):
            status, tails, failures = _follow(runner, handle, launch, app.roles[0].name)
    finally:
        runner.close()
        if secret is not None:
            secret.unlink(missing_ok=True)
    _raise_unless_succeeded(launch.name, status, tails, tail_lines, failures)


@contextlib.contextmanager
def _cancelled_unless_finished(runner, handle: str, name: str):
    """SIGTERM becomes an exception here (KFP and the kubelet stop a driver pod with it), and
    any exception cancels the job before it propagates."""

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop) if threading.current_thread() is threading.main_thread() else None
    try:
        yield
    except BaseException:
        log.warning("cancelling %s: its driver is stopping", name)
        try:
            runner.cancel(handle)
        except Exception as e:  # the job may be gone already; the original error matters more
            log.warning("could not cancel %s: %s", handle, e)
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _follow(runner, handle: str, launch: Launch, role: str, tail_lines: int = 40):
    """Stream every replica's log until the job ends; (final status, each replica's last lines,
    the failures its processes reported: `rank_failed` events, kept apart from the bounded
    tail). A replica's stream is retried (or reopened, when it ends) while the job runs: its
    pod may not exist yet, and a long follow may be closed by the API server. Every stream
    gets one last read after the job ended: a replica that crashed before its log could be
    read has its log by then."""

    done = threading.Event()
    tails = {k: deque(maxlen=tail_lines * 10) for k in range(launch.cluster.nodes)}
    failures = {k: [] for k in tails}

    def stream(k: int) -> None:
        seen = 0  # a retried stream starts from the top again: skip what was printed
        while True:
            last = done.is_set()  # a read that starts after the job ended is the last one
            try:
                for i, line in enumerate(runner.log_lines(handle, role, k, should_tail=True)):
                    if i >= seen:
                        line = line.rstrip("\n")
                        tails[k].append(line)
                        if (failure := _reported_failure(k, line)) is not None:
                            failures[k].append(failure)
                        print(f"[{launch.name}/{k}] {line}", flush=True)
                        seen += 1
                if last:
                    return
                # the stream ended while the job runs: the replica's container ended, or the API
                # server closed a long follow (its timeout, a restart). Reopened until the job
                # ends; the lines already printed are skipped, and one last read follows the end
                done.wait(5.0)
            except Exception as e:  # log streaming must never hide the job's own outcome
                if last:
                    tails[k].append(f"(log stream ended: {e})")
                    return
                done.wait(2.0)

    streams = [threading.Thread(target=stream, args=(k,), daemon=True) for k in tails]
    for t in streams:
        t.start()
    try:
        status = _wait(runner, handle, launch)
    finally:
        done.set()
    for t in streams:
        t.join(timeout=10)
    return status, tails, failures


def _wait(runner, handle: str, launch: Launch, interval: float | None = None):
    """runner.wait, with a bound on how long the job may stay unscheduled: a gang that does not
    fit (its nodes excluded, a resource no node has) would otherwise pend forever. After
    `cluster.pending_timeout_s` in PENDING the attempt fails naming why Volcano holds it."""
    from torchx.specs import AppState

    if interval is None:  # locally a status read is a process poll; on a cluster an API call
        interval = 0.2 if launch.cluster.scheduler == Scheduler.local_cwd else 1.0
    since = time.monotonic()
    while True:
        status = runner.status(handle)
        if status is None or status.is_terminal():
            return status
        if status.state == AppState.RUNNING:
            since = time.monotonic()  # it ran: only an unbroken wait unscheduled (or UNKNOWN) counts
        elif time.monotonic() - since > launch.cluster.pending_timeout_s:
            why = _why_pending(handle, launch)
            raise Unschedulable(
                f"{launch.name} still unscheduled after {launch.cluster.pending_timeout_s:g}s "
                f"(cluster.pending_timeout_s): {why}"
            )
        time.sleep(interval)


class Unschedulable(LaunchError):
    """The job was never placed: relaunching the same gang would wait again."""


def _why_pending(handle: str, launch: Launch) -> str:
    if launch.cluster.scheduler != Scheduler.kubernetes:
        return "the job's processes never started"
    namespace, _, name = handle.rpartition("/")[2].partition(":")
    try:
        return k8s.why_unscheduled(namespace, name)
    except Exception as e:  # the diagnosis must never hide the timeout itself
        return f"Volcano's reason could not be read ({type(e).__name__}: {e})"


def _raise_unless_succeeded(name: str, status, tails: dict, tail_lines: int, failures: dict | None = None) -> None:
    from torchx.specs import AppState

    if status is not None and status.state == AppState.SUCCEEDED:
        return
    head, message, hung = describe_failure(name, status, tails, tail_lines, failures)
    raise LaunchError(message, summary=head, hung=hung)
