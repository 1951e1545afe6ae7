"""A loopback HTTP server answering the KFP v2beta1 REST calls `upload` and `submit` make,
recording each request so tests can assert what was sent; its healthz reports `version`."""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

from tests.helpers import LoopbackServer


class FakeKfp(LoopbackServer):
    def __init__(self):
        self.requests: list[dict] = []
        self.pipelines: dict[str, dict] = {}
        self.versions: dict[str, list[dict]] = {}
        self.experiments: dict[str, dict] = {}
        self.runs: list[dict] = []
        self.final_state = "SUCCEEDED"  # what a run reports when `submit --wait` asks
        self.version = "2.14.0"  # the backend release its healthz reports (tag_name)
        self.through_ui = False  # answer healthz as ml-pipeline-ui does (apiServerTagName)
        self.executor = None  # run(run body) when a run is created: a test's stand-in for the cluster running it
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, body: dict, code: int = 200):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                fake._record(self, b"")
                self._reply(fake.answer("GET", self.path, b""))

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                fake._record(self, body)
                self._reply(fake.answer("POST", self.path, body))

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def _record(self, handler, body: bytes):
        u = urlparse(handler.path)
        self.requests.append(
            {
                "method": handler.command,
                "path": u.path,
                "query": parse_qs(u.query),
                "body": body,
                "headers": {k.lower(): v for k, v in handler.headers.items()},
            }
        )

    def answer(self, method: str, path: str, body: bytes) -> dict:
        u = urlparse(path)
        q = {k: v[0] for k, v in parse_qs(u.query).items()}
        p = u.path
        if method == "GET" and p in ("/apis/v2beta1/healthz", "/apis/v1beta1/healthz"):
            if self.through_ui:  # frontend/server/handlers/healthz.ts
                return {"apiServerCommitHash": "0123abc", "apiServerTagName": self.version, "apiServerReady": True}
            # backend/src/apiserver/main.go: the raw body carries the release as tag_name
            return {
                "commit_sha": "0123abc",
                "tag_name": self.version,
                "multi_user": False,
                "pipeline_store": "database",
            }
        if method == "GET" and p == "/apis/v2beta1/pipelines":
            name = _filter_value(q.get("filter"))
            found = [x for x in self.pipelines.values() if name is None or x["display_name"] == name]
            return {"pipelines": found, "total_size": len(found)} if found else {}
        if method == "POST" and p == "/apis/v2beta1/pipelines/upload":
            pid = f"p{len(self.pipelines) + 1}"
            name = q.get("name") or q.get("display_name")
            self.pipelines[pid] = {"pipeline_id": pid, "display_name": name}
            self.versions[pid] = [{"pipeline_version_id": f"{pid}-v0", "display_name": name, "pipeline_id": pid}]
            return self.pipelines[pid]
        m = re.fullmatch(r"/apis/v2beta1/pipelines/([^/]+)/versions", p)
        if method == "GET" and m:
            versions = self.versions.get(m.group(1), [])
            return {"pipeline_versions": versions, "total_size": len(versions)} if versions else {}
        if method == "POST" and p == "/apis/v2beta1/pipelines/upload_version":
            pid = q["pipelineid"]
            v = {
                "pipeline_version_id": f"{pid}-v{len(self.versions[pid])}",
                "display_name": q.get("name"),
                "pipeline_id": pid,
            }
            self.versions[pid].append(v)
            return v
        if method == "GET" and p == "/apis/v2beta1/experiments":
            name = _filter_value(q.get("filter"))
            found = [x for x in self.experiments.values() if name is None or x["display_name"] == name]
            return {"experiments": found, "total_size": len(found)} if found else {}
        if method == "POST" and p == "/apis/v2beta1/experiments":
            exp = json.loads(body)
            eid = f"e{len(self.experiments) + 1}"
            self.experiments[eid] = {**exp, "experiment_id": eid}
            return self.experiments[eid]
        if method == "POST" and p == "/apis/v2beta1/runs":
            run = json.loads(body)
            run["run_id"] = f"r{len(self.runs) + 1}"
            self.runs.append(run)
            if self.executor is not None:
                self.executor(run)
            return run
        m = re.fullmatch(r"/apis/v2beta1/runs/([^/]+)", p)
        if method == "GET" and m:
            run = next(r for r in self.runs if r["run_id"] == m.group(1))
            return {**run, "state": self.final_state, "finished_at": "2026-12-01T00:00:00Z"}
        return {}


def _filter_value(raw: str | None) -> str | None:
    if not raw:
        return None
    for pred in json.loads(raw).get("predicates", []):
        value = pred.get("stringValue") or pred.get("string_value")
        if value is not None:
            return value
    return None
