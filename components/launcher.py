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
import time
import typing
import uuid
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

# What a replica's process prints, as one log line, when an exception ends it: its rank, the
# time (epoch seconds) and the exception. The driver reads it from the replica's log stream
# (all a pod shares with it besides the store) to name the rank that failed first.
FAILURE_MARK = "liftoff-failure:"


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
    # which run this is (the spec's launch or run id, else a new one): on Kubernetes every
    # attempt's vcjob carries it, and a driver deletes only its own launch's earlier attempts
    launch_id: str = ""
    metrics_port: int = 0  # the replicas serve Prometheus metrics there: their pods carry scrape annotations

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
    report_uncaught_exceptions()
    return spec


def report_uncaught_exceptions(rank: str | None = None) -> None:
    """An exception that ends this replica's process is first logged as one `FAILURE_MARK`
    line (rank, time, type, message), then printed as usual. torch.distributed's own hook,
    installed later, calls this one: it chains."""
    previous = sys.excepthook

    def hook(kind, value, tb):
        try:
            report_failure(kind.__name__, str(value), rank)
        except Exception:  # the traceback below matters more than this line
            pass
        previous(kind, value, tb)

    sys.excepthook = hook


def report_failure(kind: str, message: str, rank: str | None = None) -> None:
    """One `FAILURE_MARK` line for this replica's rank: the launcher ranks failures by its time,
    so a process that ends itself (the watchdog) is named before the peers its exit fails."""
    rank = rank if rank is not None else os.environ.get("RANK", "?")
    record = {"rank": rank, "time": time.time(), "type": kind, "message": message}
    logging.getLogger("liftoff.failure").error("%s %s", FAILURE_MARK, json.dumps(record))


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
            **dict(cluster.env),  # NCCL_* / GLOO_*: declared like every other variable, on every node
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
    """
    attempts = launch.cluster.max_restarts + 1
    for attempt in range(attempts):
        try:
            return run_once(launch, {**(env or {}), "LIFTOFF_ATTEMPT": str(attempt)})
        except LaunchError as e:
            if attempt == attempts - 1 or isinstance(e, Unschedulable):  # the same gang would pend again
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
    on_k8s = cluster.scheduler == Scheduler.kubernetes
    name = k8s.attempt_name(launch.name, launch.launch_id, attempt_of(env)) if on_k8s else launch.name
    app = build_app(launch.module, launch.spec, cluster, name, env, launch.nodes_dir)
    try:
        if on_k8s:
            namespace = k8s.namespace(cluster.namespace)
            # two jobs must never hold the same GPUs: this launch's earlier attempt, or an orphan
            # whose driver is gone, is deleted; another run's job of the same config never is
            k8s.delete_earlier_attempts(namespace, launch.name, launch.launch_id, attempt_of(env))
            handle = runner.schedule(kubernetes_job(launch, env, runner, namespace, app))
        else:
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
    the failures its processes reported: `FAILURE_MARK` lines, kept apart from the bounded
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


def _wait(runner, handle: str, launch: Launch, interval: float = 1.0):
    """runner.wait, with a bound on how long the job may stay unscheduled: a gang that does not
    fit (its nodes excluded, a resource no node has) would otherwise pend forever. After
    `cluster.pending_timeout_s` in PENDING the attempt fails naming why Volcano holds it."""
    from torchx.specs import AppState

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
    state = status.state.name if status else "UNKNOWN"
    ranked = first_failures(tails, failures or {})
    if ranked:  # the rank that failed first is the cause; the others failed after it
        first, *after = ranked
        seen = list(tails.get(first.replica, []))
        head = f"{name} ended {state}; first failure: {first.describe()}"
        if after:
            head += " (" + "; ".join(f"{f.who()} failed after it: {f.brief()}" for f in after) + ")"
        # a replica whose log names no failure at all: its processes died without a word
        # (SIGKILLed with their agent, a lost node or pod), or were stopped before they noticed
        silent = sorted({*tails, *_failed_replicas(status)} - {f.replica for f in ranked})
        if silent:
            which = ", ".join(map(str, silent))
            head += f"; replica {which} logged no error (its processes killed, or its node lost?)"
    else:
        failing = _failing_replica(status)
        seen = list(tails.get(failing, [])) if failing is not None else [ln for k in sorted(tails) for ln in tails[k]]
        cause = root_cause(seen)
        head = (
            f"{name} ended {state}"
            + (f"; replica {failing} failed" if failing is not None else "")
            + (f": {cause}" if cause else "")
        )
    raise LaunchError(
        head
        + "; last log lines:\n"
        + "\n".join(f"  | {ln}" for ln in log_tail(seen, tail_lines))  # quoted: never read as the driver's own
    )


@dataclass(frozen=True)
class Failure:
    """One rank's failure as its replica's log tells it: its own `FAILURE_MARK` line (exact
    time, the exception), else torchrun's "Root Cause" block (the second its agent saw the
    process end: a signal, or an exception from the error file `@record` wrote)."""

    replica: int
    rank: str
    time: float
    cause: str  # `Type: message`, or how the process ended
    exact: bool = True  # False: torchrun's time, in whole seconds
    order: float | None = None  # the time it is ranked by (see `torchrun_root_causes`); None: `time`

    def __post_init__(self):
        if self.order is None:
            object.__setattr__(self, "order", self.time)

    def who(self) -> str:
        return f"replica {self.replica} rank {self.rank}"

    def describe(self) -> str:
        clock = time.strftime("%H:%M:%S", time.localtime(self.time))
        clock += f".{int(self.time * 1000) % 1000:03d}" if self.exact else ""
        return f"{self.who()} at {clock}: {self.cause}"

    def brief(self, n: int = 120) -> str:
        # gloo's source location in front of its message says nothing to a user
        text = re.sub(r"^(\w+: )\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\] ", r"\1", self.cause)
        text = re.split(r"(?<=\.) (?=[A-Z])", text, maxsplit=1)[0]  # its first sentence
        return text if len(text) <= n else text[: n - 3].rstrip() + "..."


# a process that died of these died on its own (the kernel's OOM killer, a crash); a SIGTERM
# or SIGINT is someone stopping it (its agent after a peer failed, a cancel)
_OWN_DEATH = ("SIGKILL", "SIGSEGV", "SIGABRT", "SIGBUS", "SIGFPE", "SIGILL")


def _reported_failure(replica: int, line: str) -> Failure | None:
    m = re.search(re.escape(FAILURE_MARK) + r" (\{.*\})\s*$", line)
    if not m:
        return None
    try:
        r = json.loads(m.group(1))
        return Failure(replica, str(r["rank"]), float(r["time"]), _one_line(f"{r['type']}: {r['message']}"))
    except (ValueError, KeyError, TypeError):
        return None


def _one_line(text: str) -> str:
    """A message's lines as one: `a:` then its indented items `b; c`."""
    parts = [ln.strip().removeprefix("- ") for ln in text.strip().splitlines() if ln.strip()]
    if not parts:
        return text.strip()
    out = parts[0]
    for i, part in enumerate(parts[1:]):
        out += (" " if i == 0 and out.endswith(":") else "; ") + part
    return out


# what the Kubernetes API puts before each line of a pod's log (TorchX asks for timestamps)
_POD_LOG_TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?(?:Z|[+-]\d\d:\d\d) ")
_ROOT_CAUSE_FIELD = re.compile(r"^\s{2}(time|rank|exitcode|error_file|traceback)\s*: ?(.*)$")


def torchrun_root_causes(replica: int, lines: list[str]) -> list[Failure]:
    """The "Root Cause (first observed failure)" blocks torchrun's agent printed in this replica's log."""
    from datetime import datetime

    lines = [_POD_LOG_TIME.sub("", ln) for ln in lines]
    found = []
    for i, line in enumerate(lines):
        if "Root Cause (first observed failure):" not in line:
            continue
        fields: dict[str, list[str]] = {}
        key = None
        for ln in lines[i + 2 :]:
            if re.match(r"^\s*=+\s*$", ln) or re.match(r"^\[\d+\]:", ln):
                break
            m = _ROOT_CAUSE_FIELD.match(ln)
            if m:
                key = m.group(1)
                fields[key] = [m.group(2)]
            elif key == "traceback":
                fields[key].append(ln[2:] if ln.startswith("  ") else ln)
        try:
            when = datetime.strptime(fields["time"][0].strip(), "%Y-%m-%d_%H:%M:%S").timestamp()
            rank = fields["rank"][0].split()[0]
        except (KeyError, IndexError, ValueError):
            continue
        exitcode = " ".join(fields.get("exitcode", ["?"])[0].split())
        signal_name = re.search(r"\((SIG\w+)\)", exitcode)
        code = exitcode.split()[0] if exitcode else "?"
        cause = _traceback_exception(fields.get("traceback", []))
        # Ranked against the exact times of the ranks' own reports: an exception from the
        # error file happened within its (floored) second; a process that died on its own,
        # with no exception, counts as first against exceptions up to a second later (what
        # its peers take to notice: a lost connection, a timeout); one that was stopped, or
        # exited without an exception, comes after whatever happened in its second
        if cause is not None:
            order = when + 0.5
        elif signal_name:
            cause = f"killed by {signal_name.group(1)} (exit code {code})"
            order = when - 1.0 if signal_name.group(1) in _OWN_DEATH else when + 1.0
        else:  # an exit without an exception (a watchdog's reports its own FAILURE_MARK line, exact)
            cause, order = f"exit code {code}", when + 1.0
        found.append(Failure(replica, rank, when, cause, exact=False, order=order))
    return found


def _traceback_exception(lines: list[str]) -> str | None:
    """`Type: message` of a printed traceback: the first unindented line after the frames of
    its last (outermost) exception, and the message's lines up to the next blank one."""
    if not lines or not lines[0].startswith("Traceback (most recent"):
        return None
    last = max(i for i, ln in enumerate(lines) if ln.startswith("Traceback (most recent"))
    rest = lines[last + 1 :]
    start = next((i for i, ln in enumerate(rest) if ln and not ln[0].isspace()), None)
    if start is None:
        return None
    kind, _, message = rest[start].partition(": ")
    body = [message]
    for ln in rest[start + 1 :]:
        if not ln.strip():
            break
        body.append(ln)
    return _one_line(f"{kind.rsplit('.', 1)[-1]}: " + "\n".join(body))


def first_failures(tails: dict, reported: dict) -> list[Failure]:
    """Every rank that failed, first first: each rank's own report where its log has one, else
    what torchrun's agent saw of it. Empty when no replica's log names a failed rank."""
    by_rank: dict[str, Failure] = {}
    for k in sorted(tails):
        for f in torchrun_root_causes(k, list(tails[k])):
            by_rank.setdefault(f.rank, f)
    for k in sorted(reported):
        for f in reported[k]:
            if f.rank not in by_rank or not by_rank[f.rank].exact:
                by_rank[f.rank] = f
    return sorted(by_rank.values(), key=lambda f: (f.order, f.replica))


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
    return next(iter(_failed_replicas(status)), None)


def _failed_replicas(status) -> list[int]:
    if status is None:
        return []
    return [r.id for role in status.roles for r in role.replicas if r.state.name == "FAILED"]
