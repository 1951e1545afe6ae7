"""A real Prometheus server (Debian's `prometheus`, installed by `make browser`) on 127.0.0.1,
scraping given targets, and its HTTP query API; and `promtool` on the shipped alert rules."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

from tests.conftest import free_port

JOB = "kubeflow/liftoff-train"  # the job name Prometheus Operator gives the PodMonitor's targets
ALERTS = Path(__file__).resolve().parents[1] / "deploy" / "monitoring" / "alerts.yaml"


def binary(name: str) -> str:
    path = shutil.which(name)
    assert path, f"{name} is not installed: `make browser` installs Debian's prometheus package"
    return path


def rule_file(dest: Path) -> Path:
    """The PrometheusRule's `spec` (Prometheus Operator's CRD) as a plain rule file, as the
    operator hands it to Prometheus."""
    dest.write_text(yaml.safe_dump(yaml.safe_load(ALERTS.read_text())["spec"]))
    return dest


class Prometheus:
    """`with Prometheus(tmp, targets) as p:` a server scraping `targets` (host:port) every
    `interval`, with the shipped alert rules loaded; `p.query(expr)`."""

    def __init__(self, tmp: Path, targets: list[str], interval: str = "500ms"):
        self.tmp, self.port = tmp, free_port()
        config = {
            "global": {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": interval},
            "rule_files": [str(rule_file(tmp / "alerts.rules.yaml"))],
            "scrape_configs": [{"job_name": JOB, "static_configs": [{"targets": targets}]}],
        }
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Prometheus:
        self.log = open(self.tmp / "prometheus.log", "w")
        args = [binary("prometheus"), f"--config.file={self.tmp / 'prometheus.yml'}",
                f"--storage.tsdb.path={self.tmp / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}"]  # fmt: skip
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, (self.tmp / "prometheus.log").read_text()[-2000:]
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.2)
        raise TimeoutError("prometheus did not become ready in 60 s")

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()

    def query(self, expr: str) -> list[dict]:
        """The API's result for an instant query now: [{metric: labels, value or values}]."""
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]["result"]


def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([binary("promtool"), *args], cwd=cwd, capture_output=True, text=True, timeout=120)
