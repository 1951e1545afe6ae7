"""TorchX launch, shared by train and preflight: `dist.torchrun` with -j NODESxPROCS on
local_cwd or kubernetes (Volcano)."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import logging
import os
import re
import signal
import socket
import sys
import threading
import typing
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from components import k8s, local_pod
from components.config import ClusterConfig, Scheduler

log = logging.getLogger(__name__)
# A module a worker imports when this is set in its environment and calls `install(...)` on:
# how tests inject faults (a NaN, a dead or slow rank, a degraded node) into real runs.
PLUGIN_ENV = "LIFTOFF_WORKER_PLUGIN"
PLUGIN_ARGS_ENV = "LIFTOFF_WORKER_PLUGIN_ARGS"  # the plugin's own settings (which faults), as JSON


# Warnings the replicas print on every launch with nothing to act on, filtered in the replicas
# (declared in their environment, on Kubernetes as locally): DDP's deprecation of the
# `broadcast_buffers` argument, whose replacement changes what it means (components/train/parallel.py).
QUIET_WARNINGS = "ignore:`broadcast_buffers` is deprecated:FutureWarning"


class LaunchError(RuntimeError):
    pass


class WorkerSpec:
    """Base of what a stage tells the workers it launches: a dataclass whose fields are plain
    JSON values or config groups. Encoded once, here, into the worker's command line."""

    def to_json(self) -> dict:
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_json(cls, data: dict):
        from components.config import group_from_dict

        hints = typing.get_type_hints(cls)
        groups = {f.name for f in dataclasses.fields(cls) if dataclasses.is_dataclass(hints[f.name])}
        return cls(**{k: group_from_dict(hints[k], v) if k in groups else v for k, v in data.items()})

    def encode(self) -> str:
        return base64.urlsafe_b64encode(json.dumps(self.to_json()).encode()).decode()

    @classmethod
    def decode(cls, text: str):
        return cls.from_json(json.loads(base64.urlsafe_b64decode(text.encode()).decode()))


def _plain(value):
    from components.config import as_plain_dict, drop_none

    return drop_none(as_plain_dict(value)) if dataclasses.is_dataclass(value) else value


@dataclass
class Launch:
    """One TorchX job a stage launches: the worker module and its spec, where, under what name."""

    module: str
    spec: WorkerSpec
    cluster: ClusterConfig
    name: str
    log_dir: Path
    nodes_dir: Path  # locally, replica i lives in nodes_dir/<i>/ (its cwd, HOME, TMPDIR): a pod's own disk
    exclude_nodes: tuple[str, ...] = ()  # Kubernetes nodes the replicas must not run on (preflight's verdict)

    @property
    def store_secret(self) -> str | None:
        """The Secret the replicas read the store's keys from (MinIO only)."""
        store = getattr(self.spec, "store", None)
        return store.secret_name if store is not None and store.backend.value == "minio" else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_spec(argv: list[str] | None, spec_type: type[WorkerSpec]):
    """The start of every launched worker: its typed spec from `--spec-b64`, log lines that name
    the rank, and the thread count the launcher chose for this host."""
    import argparse

    import torch

    parser = argparse.ArgumentParser()
    parser.add_argument("--spec-b64", required=True)
    spec = spec_type.decode(parser.parse_args(argv).spec_b64)
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s rank{os.environ.get('RANK', '?')} %(levelname)s %(name)s: %(message)s",
        stream=sys.stdout,
    )
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    return spec


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


def build_app(module: str, spec: WorkerSpec, cluster: ClusterConfig, name: str, env: dict[str, str], nodes_dir=None):
    """The TorchX AppDef of a launch. Its replicas' environment is exactly what is declared
    here, on Kubernetes as in the local simulation of a pod (`components/local_pod.py`)."""
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
            **plugin_env(),
            **env,
        },
    )
    role = app.roles[0]
    if cluster.scheduler == Scheduler.local_cwd:
        role.env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
        role.env["NODE_NAME"] = f"{socket.gethostname()}-node{macros.replica_id}"  # one host, several "nodes"
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


def kubernetes_job(
    launch: Launch, env: dict[str, str] | None = None, runner=None, namespace: str | None = None, app=None
):
    """TorchX's own dry run of the job on Kubernetes, finished by `k8s.finish_job`: what a
    cluster run submits and what `liftoff render` writes."""
    from torchx.runner import get_runner

    runner = runner or get_runner()
    app = app or build_app(launch.module, launch.spec, launch.cluster, launch.name, env or {})
    info = runner.dryrun(app, "kubernetes", cfg=scheduler_cfg(launch.cluster, launch.log_dir, namespace))
    k8s.finish_job(info.request.resource, launch.cluster, launch.store_secret, launch.name, launch.exclude_nodes)
    return info


def run_app(launch: Launch, env: dict[str, str] | None = None) -> None:
    """Run the job, relaunching it up to `cluster.max_restarts` times after a failure.

    Restarts are whole-job relaunches (a fresh rendezvous) rather than torchrun's
    --max_restarts: with several elastic agents, one failure can restart each agent a
    different number of times, and their workers then look for each other under different
    store prefixes and never connect. The workers resume from the newest valid checkpoint.
    """
    attempts = launch.cluster.max_restarts + 1
    for attempt in range(attempts):
        try:
            return run_once(launch, {**(env or {}), "LIFTOFF_ATTEMPT": str(attempt)})
        except LaunchError as e:
            if attempt == attempts - 1:
                raise
            log.warning(
                "%s failed (attempt %d of %d); relaunching: %s",
                launch.name,
                attempt + 1,
                attempts,
                str(e).splitlines()[0],
            )


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
    app = build_app(launch.module, launch.spec, cluster, launch.name, env, launch.nodes_dir)
    try:
        if cluster.scheduler == Scheduler.kubernetes:
            namespace = k8s.namespace(cluster.namespace)
            k8s.delete_earlier_attempts(namespace, launch.name)  # a UI Retry must not leave two jobs on the GPUs
            handle = runner.schedule(kubernetes_job(launch, env, runner, namespace, app))
        else:
            handle = runner.run(app, scheduler=cluster.scheduler.value, cfg=scheduler_cfg(cluster, launch.log_dir))
        log.info("launched %s on %s: %s", launch.name, cluster.scheduler.value, handle)
        with _cancelled_unless_finished(runner, handle, launch.name):
            status, tails = _follow(runner, handle, launch, app.roles[0].name)
    finally:
        runner.close()
        if secret is not None:
            secret.unlink(missing_ok=True)
    _raise_unless_succeeded(launch.name, status, tails, tail_lines)


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
    """Stream every replica's log until the job ends; (final status, each replica's last lines).
    A replica's stream is retried while the job runs: its pod may not exist yet. A stream that
    failed gets one last read after the job ended: a replica that crashed before its log could
    be read has its log by then."""

    done = threading.Event()
    tails = {k: deque(maxlen=tail_lines * 10) for k in range(launch.cluster.nodes)}

    def stream(k: int) -> None:
        seen = 0  # a retried stream starts from the top again: skip what was printed
        while True:
            last = done.is_set()  # a read that starts after the job ended is the last one
            try:
                for i, line in enumerate(runner.log_lines(handle, role, k, should_tail=True)):
                    if i >= seen:
                        line = line.rstrip("\n")
                        tails[k].append(line)
                        print(f"[{launch.name}/{k}] {line}", flush=True)
                        seen += 1
                return
            except Exception as e:  # log streaming must never hide the job's own outcome
                if last:
                    tails[k].append(f"(log stream ended: {e})")
                    return
                done.wait(2.0)

    streams = [threading.Thread(target=stream, args=(k,), daemon=True) for k in tails]
    for t in streams:
        t.start()
    status = runner.wait(handle, wait_interval=1)
    done.set()
    for t in streams:
        t.join(timeout=10)
    return status, tails


def _raise_unless_succeeded(name: str, status, tails: dict, tail_lines: int) -> None:
    from torchx.specs import AppState

    if status is not None and status.state == AppState.SUCCEEDED:
        return
    state = status.state.name if status else "UNKNOWN"
    failing = _failing_replica(status)
    seen = list(tails.get(failing, [])) if failing is not None else [ln for k in sorted(tails) for ln in tails[k]]
    cause = root_cause(seen)
    raise LaunchError(
        f"{name} ended {state}"
        + (f"; replica {failing} failed" if failing is not None else "")
        + (f": {cause}" if cause else "")
        + "; last log lines:\n"
        + "\n".join(f"  | {ln}" for ln in log_tail(seen, tail_lines))  # quoted: never read as the driver's own
    )


# torchrun's C++ stack frames and banners after a worker died: they push the worker's own
# last words (its exception, the watchdog's thread dump) out of any fixed-size tail
_NOISE = re.compile(r"^(frame #\d+:|Exception raised from |=+$|\[W\d+ |\s*\^+$)")


def log_tail(lines: list[str], n: int) -> list[str]:
    """The last `n` meaningful lines; a watchdog's thread dump is kept whole (capped at 3n)
    because the stacks are the one thing that explains a hang."""
    kept = [ln for ln in lines if not _NOISE.match(ln)]
    dump = next((i for i in range(len(kept) - 1, -1, -1) if "watchdog: no training progress" in kept[i]), None)
    if dump is None:
        return kept[-n:]
    end = dump + 3 * n
    return kept[dump:end] + (["..."] if len(kept) > end else []) + kept[max(end, len(kept) - n) :]


def root_cause(lines: list[str]) -> str | None:
    """The worker's own exception line (`SomeError: message`), not torchrun's wrapper."""
    for line in reversed(lines):
        m = re.search(r"\b(\w+(?:Error|Exception)): (.+)$", line)
        if m and m.group(1) not in ("ChildFailedError",):
            return f"{m.group(1)}: {m.group(2).strip()}"
    return None


def _failing_replica(status) -> int | None:
    if status is None:
        return None
    for role in status.roles:
        for replica in role.replicas:
            if replica.state.name == "FAILED":
                return replica.id
    return None
