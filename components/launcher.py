"""TorchX launch, shared by train and preflight: `dist.torchrun` with -j NODESxPROCS on
local_cwd or kubernetes (Volcano)."""

from __future__ import annotations

import base64
import json
import logging
import os
import re
import socket
import sys
import threading
from collections import deque
from pathlib import Path

from components.config import ClusterConfig, Scheduler

log = logging.getLogger(__name__)
# A module a worker imports when this is set in its environment and calls `install(...)` on:
# how tests inject faults (a NaN, a dead or slow rank, a degraded node) into real runs.
PLUGIN_ENV = "LIFTOFF_WORKER_PLUGIN"


class LaunchError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def decode_spec(text: str) -> dict:
    return json.loads(base64.urlsafe_b64decode(text.encode()).decode())


def encode_spec(spec: dict) -> str:
    return base64.urlsafe_b64encode(json.dumps(spec).encode()).decode()


def worker_spec(argv: list[str] | None) -> dict:
    """The start of every launched worker: its spec from `--spec-b64`, log lines that name the
    rank, and the thread count the launcher chose for this host."""
    import argparse

    import torch

    parser = argparse.ArgumentParser()
    parser.add_argument("--spec-b64", required=True)
    spec = decode_spec(parser.parse_args(argv).spec_b64)
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


def build_app(module: str, spec: dict, cluster: ClusterConfig, name: str, env: dict[str, str]):
    from torchx.components import dist

    port = cluster.rdzv_port or free_port()
    app = dist.torchrun(
        "--spec-b64",
        encode_spec(spec),
        m=module,
        name=name,
        image=cluster.image,
        j=f"{cluster.nodes}x{cluster.procs_per_node}",
        cpu=cluster.cpu,
        gpu=cluster.gpu,
        memMB=cluster.mem_mb,
        rdzv_port=port,
        env={"OMP_NUM_THREADS": str(threads_per_process(cluster)), "LOGLEVEL": "WARNING", **env},
    )
    role = app.roles[0]
    if cluster.scheduler == Scheduler.local_cwd:
        role.env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    if cluster.node_selector and cluster.scheduler == Scheduler.kubernetes:
        role.metadata = {"kubernetes": {"node_selector": dict(cluster.node_selector)}}
    return app


def scheduler_cfg(cluster: ClusterConfig, log_dir: Path) -> dict:
    if cluster.scheduler == Scheduler.local_cwd:
        return {"log_dir": str(log_dir)}
    cfg = {"queue": cluster.queue, "namespace": cluster.namespace}
    if cluster.service_account:
        cfg["service_account"] = cluster.service_account
    return cfg


def run_app(
    module: str, spec: dict, cluster: ClusterConfig, name: str, log_dir: Path, env: dict[str, str] | None = None
) -> None:
    """Run the job, relaunching it up to `cluster.max_restarts` times after a failure.

    Restarts are whole-job relaunches (a fresh rendezvous) rather than torchrun's
    --max_restarts: with several elastic agents, one failure can restart each agent a
    different number of times, and their workers then look for each other under different
    store prefixes and never connect. The workers resume from the newest valid checkpoint.
    """
    for attempt in range(cluster.max_restarts + 1):
        try:
            return run_once(module, spec, cluster, name, log_dir, {**(env or {}), "LIFTOFF_ATTEMPT": str(attempt)})
        except LaunchError as e:
            if attempt == cluster.max_restarts:
                raise
            log.warning(
                "%s failed (attempt %d of %d); relaunching: %s",
                name,
                attempt + 1,
                cluster.max_restarts + 1,
                str(e).splitlines()[0],
            )


def run_once(
    module: str, spec: dict, cluster: ClusterConfig, name: str, log_dir: Path, env: dict[str, str], tail_lines: int = 40
) -> None:
    """Launch, stream every replica's log lines, wait; raise LaunchError with the failing
    replica's last lines when the job does not succeed."""
    from torchx.runner import get_runner
    from torchx.specs import AppState

    app = build_app(module, spec, cluster, name, env)
    role = app.roles[0]
    log_dir.mkdir(parents=True, exist_ok=True)
    runner = get_runner()
    handle = runner.run(app, scheduler=cluster.scheduler.value, cfg=scheduler_cfg(cluster, log_dir))
    log.info("launched %s on %s: %s", name, cluster.scheduler.value, handle)
    tails = {k: deque(maxlen=tail_lines * 10) for k in range(cluster.nodes)}

    def stream(k: int) -> None:
        try:
            for line in runner.log_lines(handle, role.name, k, should_tail=True):
                line = line.rstrip("\n")
                tails[k].append(line)
                print(f"[{name}/{k}] {line}", flush=True)
        except Exception as e:  # log streaming must never hide the job's own outcome
            tails[k].append(f"(log stream ended: {e})")

    streams = [threading.Thread(target=stream, args=(k,), daemon=True) for k in range(cluster.nodes)]
    for t in streams:
        t.start()
    status = runner.wait(handle, wait_interval=1)
    for t in streams:
        t.join(timeout=10)
    runner.close()
    if status is None or status.state != AppState.SUCCEEDED:
        state = status.state.name if status else "UNKNOWN"
        failing = _failing_replica(status)
        seen = list(tails.get(failing, [])) if failing is not None else [ln for k in sorted(tails) for ln in tails[k]]
        cause = root_cause(seen)
        raise LaunchError(
            f"{name} ended {state}"
            + (f"; replica {failing} failed" if failing is not None else "")
            + (f": {cause}" if cause else "")
            + "; last log lines:\n"
            + "\n".join(log_tail(seen, tail_lines))
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
