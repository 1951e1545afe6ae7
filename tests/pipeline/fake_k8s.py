"""A loopback HTTP server answering the Kubernetes API calls a cluster run makes (Volcano
jobs and their status, pods, pod logs, nodes), recording each one as the RBAC
(apiGroup, resource, verb) it needs. A job completes after `running_polls` status reads.

Modes for the driver's lifecycle: `log_errors` are the codes the first pod-log reads of each
replica answer (404 while its pod does not exist, 400 while its container is being created),
and the job keeps running until every replica's have been answered; `fail_replica` ends the
job Failed with that replica's task Failed and `FAIL_LINE` last in its log; `replica_logs`
replaces a replica's log lines (each served as the API does, after an RFC 3339 timestamp);
`on_status_read(n)` is called on the n-th job status read (a test sends the driver a signal
from it); `unschedulable` keeps every job Pending, its PodGroup's Unschedulable condition and a
warning event carrying that message (as Volcano's gang plugin and job controller write them).

For ownership: jobs are listed by their `labelSelector` (equality terms), every created job's
name is kept in `created`, and `pods` are the pods besides the replicas' (a driver pod: name
-> {"uid", "phase"}, or None for one that no longer exists: 404).

For `liftoff doctor`, the cluster's facts: `namespaces` (name -> its labels; one not named is
404), `nodes` (the node list, `gpu_node` makes one; a node not listed still answers a get by
name, as the quarantine tests need), Volcano `queues` (name -> status.state, cluster-scoped)
and `deployments` ((namespace, name) -> the image of its one container)."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

from tests.helpers import LoopbackServer

PATH = re.compile(
    r"^/(?:api/v1|apis/(?P<group>[^/]+)/[^/]+)(?:/namespaces/(?P<ns>[^/]+))?/(?P<resource>[^/]+)"
    r"(?:/(?P<name>[^/]+))?(?:/(?P<sub>[^/]+))?$"
)
VERBS = {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}
FAIL_LINE = "RuntimeError: boom-sentinel"


class FakeK8s(LoopbackServer):
    def __init__(
        self,
        earlier_jobs: list[str] = (),
        running_polls: int = 2,
        log_errors: Sequence[int] = (),
        fail_replica: int | None = None,
        on_status_read: Callable[[int], None] | None = None,
        replica_logs: dict[int, list[str]] | None = None,
        pods: dict[str, dict | None] | None = None,
        unschedulable: str | None = None,
        namespaces: dict[str, dict[str, str]] | None = None,
        nodes: list[dict] | None = None,
        queues: dict[str, str] | None = None,
        deployments: dict[tuple[str, str], str] | None = None,
    ):
        self.calls: list[tuple[str, str, str]] = []  # (group, resource[/sub], verb)
        self.jobs: dict[str, dict] = {name: {"metadata": {"name": name}} for name in earlier_jobs}
        self.deleted: list[str] = []
        self.created: list[str] = []
        self.replica_logs = dict(replica_logs or {})
        self.pods = dict(pods or {})
        self.status_updates: list[tuple[str, dict]] = []  # (job name, body) of each jobs/status PUT
        self.status_reads = 0
        self.running_polls = running_polls
        self.log_errors = tuple(log_errors)
        self.log_reads: dict[int, list[int]] = {}  # replica -> the code each of its pod-log reads got
        self.fail_replica = fail_replica
        self.on_status_read = on_status_read
        self.unschedulable = unschedulable  # every job stays Pending; its PodGroup says this
        self.namespaces = dict(namespaces or {})
        self.nodes = list(nodes or [])
        self.queues = dict(queues or {})
        self.deployments = dict(deployments or {})
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _handle(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0) or 0))
                code, reply, text = fake.answer(self.command, self.path, body)
                data = text.encode() if text is not None else json.dumps(reply).encode()
                self.send_response(code)
                self.send_header("Content-Type", "text/plain" if text is not None else "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def kubeconfig(self) -> str:
        return json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
                "users": [{"name": "fake", "user": {"token": "fake"}}],
                "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": "team-a"}}],
                "current-context": "fake",
            }
        )

    def answer(self, method: str, raw: str, body: bytes):
        u = urlparse(raw)
        query = parse_qs(u.query)
        m = PATH.match(u.path)
        if not m:
            return 404, {"kind": "Status", "code": 404}, None
        group, resource, name, sub = m.group("group") or "", m.group("resource"), m.group("name"), m.group("sub")
        verb = VERBS.get(method) or ("get" if name else "watch" if query.get("watch") == ["true"] else "list")
        self.calls.append((group, f"{resource}/{sub}" if sub else resource, verb))
        if resource == "jobs":
            return self._jobs(method, name, sub, body, query.get("labelSelector", [""])[0])
        if resource == "pods" and sub == "log":
            return self._log(name)
        if resource == "pods" and name in self.pods:
            if self.pods[name] is None:
                return 404, {"kind": "Status", "status": "Failure", "reason": "NotFound", "code": 404}, None
            meta = {"name": name, "namespace": m.group("ns"), "uid": self.pods[name]["uid"]}
            status = {"phase": self.pods[name]["phase"]}
            return 200, {"metadata": meta, "spec": {"containers": []}, "status": status}, None
        if resource == "pods":
            pod = {"metadata": {"name": name}, "spec": {"containers": [{"name": name.rsplit("-", 1)[0]}]}}
            return 200, {**pod, "status": {"phase": "Running", "podIP": "10.0.0.1"}}, None
        if resource == "podgroups":  # Volcano names a job's PodGroup <job>-<uid>, owned by the job
            return 200, {"items": [self._podgroup(j) for j in self.jobs.values() if "spec" in j]}, None
        if resource == "events":
            items = [
                {
                    "metadata": {"name": f"{name}.1"},
                    "involvedObject": {"kind": "Job", "name": name},
                    "reason": "PodGroupPending",
                    "message": f"PodGroup {name} unschedulable, reason: {self.unschedulable}",
                    "type": "Warning",
                }
                for name in self.created
            ]
            return 200, {"items": items if self.unschedulable else []}, None
        if resource == "nodes":
            if name is None:
                return 200, {"kind": "NodeList", "metadata": {}, "items": self.nodes}, None
            listed = next((n for n in self.nodes if n["metadata"]["name"] == name), None)
            return 200, listed or {"metadata": {"name": name, "labels": {}}, "spec": {}}, None
        return self._cluster_facts(resource, m.group("ns"), name)

    def _cluster_facts(self, resource: str, ns: str | None, name: str | None):
        """Namespaces, Volcano queues and Deployments: what `liftoff doctor` reads."""
        missing = 404, {"kind": "Status", "status": "Failure", "reason": "NotFound", "code": 404}, None
        if resource == "namespaces" and name in self.namespaces:
            return (
                200,
                {"metadata": {"name": name, "labels": self.namespaces[name]}, "status": {"phase": "Active"}},
                None,
            )
        if resource == "queues" and name in self.queues:
            queue = {"apiVersion": "scheduling.volcano.sh/v1beta1", "kind": "Queue", "metadata": {"name": name}}
            return 200, {**queue, "spec": {"weight": 1}, "status": {"state": self.queues[name]}}, None
        if resource == "deployments" and (ns, name) in self.deployments:
            container = {"name": name, "image": self.deployments[(ns, name)]}
            spec = {"selector": {"matchLabels": {"app": name}}, "template": {"spec": {"containers": [container]}}}
            return 200, {"metadata": {"name": name, "namespace": ns}, "spec": spec}, None
        return missing

    def _log(self, pod: str):
        replica = int(pod.rsplit("-", 2)[1])  # TorchX names a replica's pod <job>-<role>-<k>-0
        with self.lock:
            reads = self.log_reads.setdefault(replica, [])
            code = self.log_errors[len(reads)] if len(reads) < len(self.log_errors) else 200
            reads.append(code)
        if code != 200:
            why = "NotFound" if code == 404 else "BadRequest"
            return code, {"kind": "Status", "status": "Failure", "reason": why, "code": code}, None
        if replica in self.replica_logs:
            return 200, None, "".join(f"2026-12-01T00:00:00.000000000Z {ln}\n" for ln in self.replica_logs[replica])
        text = "2026-12-01T00:00:00Z replica says hello\n"
        if replica == self.fail_replica:
            text += 'Traceback (most recent call last):\n  File "worker.py", line 1, in <module>\n' + FAIL_LINE + "\n"
        return 200, None, text

    def _logs_pending(self) -> bool:
        with self.lock:
            return any(len(self.log_reads.get(k, ())) < len(self.log_errors) for k in self._replicas())

    def _replicas(self) -> list[int]:
        created = [job for job in self.jobs.values() if "spec" in job]
        return [int(t["name"].rpartition("-")[2]) for job in created for t in job["spec"]["tasks"]]

    def _jobs(self, method: str, name: str | None, sub: str | None, body: bytes, selector: str = ""):
        if method == "POST":
            job = json.loads(body)
            self.jobs[job["metadata"]["name"]] = job
            self.created.append(job["metadata"]["name"])
            return 201, job, None
        if method == "DELETE":
            self.deleted.append(name)
            self.jobs.pop(name, None)
            return 200, {"kind": "Status", "status": "Success"}, None
        if name is None:
            wanted = dict(term.split("=", 1) for term in selector.split(",") if term)
            items = [j for j in self.jobs.values() if wanted.items() <= (j["metadata"].get("labels") or {}).items()]
            return 200, {"items": items}, None
        job = self.jobs[name]
        if sub == "status" and method == "PUT":
            update = json.loads(body)
            self.status_updates.append((name, update))
            job["status"] = update.get("status", {})
            return 200, {**job}, None
        if sub == "status" and method == "GET":
            with self.lock:
                self.status_reads += 1
                n = self.status_reads
            if self.on_status_read:
                self.on_status_read(n)
            return 200, {**job, "status": self._status(job, n)}, None
        return 200, job, None

    def _podgroup(self, job: dict) -> dict:
        name = job["metadata"]["name"]
        meta = {"name": f"{name}-0a1b", "ownerReferences": [{"kind": "Job", "name": name, "uid": "0a1b"}]}
        if not self.unschedulable:
            return {"metadata": meta, "status": {"phase": "Running"}}
        condition = {"type": "Unschedulable", "status": "True", "reason": "NotEnoughResources"}
        return {
            "metadata": meta,
            "status": {"phase": "Pending", "conditions": [{**condition, "message": self.unschedulable}]},
        }

    def _status(self, job: dict, reads: int) -> dict:
        if self.unschedulable and job.get("status", {}).get("state", {}).get("phase") != "Aborted":
            return {"state": {"phase": "Pending"}, "taskStatusCount": {}}
        if job.get("status", {}).get("state", {}).get("phase") == "Aborted":  # cancelled
            return job["status"]
        done = reads > self.running_polls and not self._logs_pending()
        tasks = {}
        for t in job["spec"]["tasks"]:
            k = int(t["name"].rpartition("-")[2])
            tasks[t["name"]] = {
                "phase": {"Running" if not done else "Failed" if k == self.fail_replica else "Succeeded": 1}
            }
        failed = self.fail_replica is not None
        return {
            "state": {"phase": "Running" if not done else "Failed" if failed else "Completed"},
            "taskStatusCount": tasks,
        }


def gpu_node(
    name: str,
    cpu: str = "128",
    memory: str = "1000Gi",
    gpus: int = 8,
    product: str = "NVIDIA-H200",
    ephemeral: str = "1Ti",
    taints: list[dict] = (),
    **extra: str,
) -> dict:
    """A node as the API server lists it: allocatable resources, the GPU operator's product label,
    the GPU taint the replicas tolerate, and `extra` allocatable ({"rdma/ib": "8"} as rdma__ib="8")."""
    allocatable = {"cpu": cpu, "memory": memory, "ephemeral-storage": ephemeral, "pods": "110"}
    allocatable |= {"nvidia.com/gpu": str(gpus)} if gpus else {}
    allocatable |= {k.replace("__", "/"): v for k, v in extra.items()}
    return {
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, "nvidia.com/gpu.product": product}},
        "spec": {"taints": [{"key": "nvidia.com/gpu", "effect": "NoSchedule"}, *taints]},
        "status": {"allocatable": allocatable, "capacity": allocatable},
    }


def train_launch_on(cluster, tmp_path):
    """A real train job's Launch (store=minio, so its replicas read the store Secret), named
    train-abc: what the driver submits, against this fake."""
    import dataclasses

    from omegaconf import OmegaConf

    from components.config import compose
    from components.train.stage import train_launch

    cfg = OmegaConf.to_object(compose(["store=minio"]))
    _, _, launch = train_launch("dataset/d@v", cfg.model, cfg.train, cluster, cfg.store, cache_gb=cfg.data.cache_gb)
    return dataclasses.replace(launch, name="train-abc", log_dir=tmp_path / "logs", nodes_dir=tmp_path / "nodes")
