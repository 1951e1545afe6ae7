"""A loopback HTTP server answering the Kubernetes API calls a cluster run makes (Volcano
jobs and their status, pods, pod logs, nodes), recording each one as the RBAC
(apiGroup, resource, verb) it needs. A job completes after `running_polls` status reads."""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

PATH = re.compile(
    r"^/(?:api/v1|apis/(?P<group>[^/]+)/[^/]+)(?:/namespaces/(?P<ns>[^/]+))?/(?P<resource>[^/]+)"
    r"(?:/(?P<name>[^/]+))?(?:/(?P<sub>[^/]+))?$"
)
VERBS = {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}


class FakeK8s:
    def __init__(self, earlier_jobs: list[str] = (), running_polls: int = 2):
        self.calls: list[tuple[str, str, str]] = []  # (group, resource[/sub], verb)
        self.jobs: dict[str, dict] = {name: {"metadata": {"name": name}} for name in earlier_jobs}
        self.deleted: list[str] = []
        self.status_reads = 0
        self.running_polls = running_polls
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
            return self._jobs(method, name, sub, body)
        if resource == "pods" and sub == "log":
            return 200, None, "2026-12-01T00:00:00Z replica says hello\n"
        if resource == "pods":
            pod = {"metadata": {"name": name}, "spec": {"containers": [{"name": name.rsplit("-", 1)[0]}]}}
            return 200, {**pod, "status": {"phase": "Running", "podIP": "10.0.0.1"}}, None
        if resource == "nodes":
            return 200, {"metadata": {"name": name, "labels": {}}, "spec": {}}, None
        return 404, {"kind": "Status", "code": 404}, None

    def _jobs(self, method: str, name: str | None, sub: str | None, body: bytes):
        if method == "POST":
            job = json.loads(body)
            self.jobs[job["metadata"]["name"]] = job
            return 201, job, None
        if method == "DELETE":
            self.deleted.append(name)
            self.jobs.pop(name, None)
            return 200, {"kind": "Status", "status": "Success"}, None
        if name is None:
            return 200, {"items": list(self.jobs.values())}, None
        job = self.jobs[name]
        if sub == "status" and method == "GET":
            self.status_reads += 1
            done = self.status_reads > self.running_polls
            tasks = {t["name"]: {"phase": {"Succeeded" if done else "Running": 1}} for t in job["spec"]["tasks"]}
            return (
                200,
                {**job, "status": {"state": {"phase": "Completed" if done else "Running"}, "taskStatusCount": tasks}},
                None,
            )
        return 200, job, None

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
