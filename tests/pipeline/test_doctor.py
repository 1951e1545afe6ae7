"""Issue 42, point 2 (acceptance 5 and 8): `liftoff doctor` against a loopback cluster (the fake API
server, tests/pipeline/fake_k8s.py), a loopback KFP (fake_kfp.py) and a real S3 (moto's server),
with one unhealthy fact at a time: one row per check, exit 0 when all pass, else the table and
one line on stderr naming the failing row, exit 2. `submit` and `upload` refuse in that line
before any call to KFP; --skip-doctor submits and the run's name says so. SeaweedFS before 4.08
on a versioned bucket is emulated by a real HTTP proxy in front of moto (`SeaweedfsProxy`): the
probe catches what would lose the run lease at its first heartbeat."""

from __future__ import annotations

import contextlib
import http.client
import json
import threading
import time
from collections import namedtuple
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from components.store import Lease, LeaseLost, code_version, open_store
from pipelines.cli import main
from pipelines.cluster import DOCTOR_SKIPPED, short_commit
from pipelines.pod_security import ENFORCE_LABEL
from tests.conftest import store_config
from tests.helpers import CLUSTER, DOCTOR_ROWS, LoopbackServer
from tests.pipeline.fake_k8s import FakeK8s, gpu_node
from tests.pipeline.fake_kfp import FakeKfp
from tests.store_objects import object_versions

ROWS = DOCTOR_ROWS
NAMESPACE = "team-a"
# the guide's replicas: hostPath NVMe and IPC_LOCK, so their namespace must enforce `privileged`
PRIVILEGED = [
    "cluster.capabilities=[IPC_LOCK]",
    "cluster.volumes=[{name:nvme,mount_path:/scratch,kind:hostPath,host_path:/mnt/nvme}]",
]
HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade"}
PRECONDITION_FAILED = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>PreconditionFailed</Code><Message>At least one of '
    b"the pre-conditions you specified did not hold</Message><Resource>{key}</Resource><RequestId>1</RequestId>"
    b"</Error>"
)


class SeaweedfsProxy(LoopbackServer):
    """SeaweedFS 4.00-4.07 on a versioned bucket (seaweedfs#8073), in front of moto: a real HTTP
    proxy that forwards every request with http.client, headers and bodies streamed through
    unchanged, except that a PUT's `If-None-Match` is dropped (the create always succeeds) and a
    PUT carrying `If-Match` is answered 412 PreconditionFailed (every compare-and-swap fails)."""

    def __init__(self, upstream: str):
        host, port = upstream.rsplit(":", 1)
        self.seen: list[dict[str, str]] = []  # the headers of every PUT the client sent
        self.forwarded: list[dict[str, str]] = []  # ... and of those moto got

        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _body(self):
                """The request body, in chunks, as it arrives."""
                left = int(self.headers.get("Content-Length") or 0)
                while left:
                    chunk = self.rfile.read(min(1 << 16, left))
                    left -= len(chunk)
                    yield chunk

            def _refuse(self):
                for _ in self._body():  # read to the end: the connection is kept alive
                    pass
                data = PRECONDITION_FAILED.replace(b"{key}", self.path.split("?")[0].encode())
                self.send_response(412, "Precondition Failed")
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _forward(self):
                headers = [(k, v) for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP]
                if self.command == "PUT":
                    proxy.seen.append({k.lower(): v for k, v in headers})
                    if any(k.lower() == "if-match" for k, _ in headers):
                        return self._refuse()
                    headers = [(k, v) for k, v in headers if k.lower() != "if-none-match"]
                    proxy.forwarded.append({k.lower(): v for k, v in headers})
                conn = http.client.HTTPConnection(host, int(port), timeout=30)
                try:
                    conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                    for k, v in headers:
                        conn.putheader(k, v)
                    conn.endheaders()
                    for chunk in self._body():
                        conn.send(chunk)
                    self._reply(conn.getresponse())
                finally:
                    conn.close()

            def _reply(self, resp):
                self.send_response(resp.status, resp.reason)
                length = resp.getheader("Content-Length")
                for k, v in resp.getheaders():
                    if k.lower() not in HOP_BY_HOP:
                        self.send_header(k, v)
                if length is None and self.command != "HEAD":  # upstream chunked it: framed here by length
                    data = resp.read()
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                self.end_headers()
                while self.command != "HEAD" and (chunk := resp.read(1 << 16)):
                    self.wfile.write(chunk)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)


def healthy_nodes(n: int = 3) -> list[dict]:
    return [gpu_node(f"gpu-{i}") for i in range(n)]


def replaced(base: list[str], *extra: str) -> list[str]:
    """`base` with `extra` added, an entry of `base` for a key `extra` sets left out (Hydra refuses
    a key given twice)."""
    keys = {e.split("=", 1)[0].lstrip("+~") for e in extra}
    return [*(b for b in base if b.split("=", 1)[0].lstrip("+~") not in keys), *extra]


class Cluster:
    """The loopback cluster, KFP and store of one test: healthy unless a test changes a fact."""

    def __init__(self, tmp_path, monkeypatch, s3_endpoint: str):
        self.tmp_path, self.monkeypatch = tmp_path, monkeypatch
        self.store_cfg = store_config("minio", tmp_path)
        open_store(self.store_cfg)  # the bucket, made as deploy/README.md step 1 makes it
        self.endpoint = s3_endpoint
        self.image = f"registry.example.com/liftoff:{short_commit(code_version())}"
        self.k8s = FakeK8s(
            namespaces={NAMESPACE: {ENFORCE_LABEL: "privileged"}, "kubeflow": {ENFORCE_LABEL: "baseline"}},
            nodes=healthy_nodes(),
            queues={"default": "Open"},
            deployments={("kubeflow", "ml-pipeline"): "ghcr.io/kubeflow/kfp-api-server:2.16.1"},
        )
        self.kfp = FakeKfp()
        self.kfp.version = "2.16.1"
        self.stack = contextlib.ExitStack()  # what a test adds (a proxy), closed with the cluster

    def overrides(self, *extra: str) -> list[str]:
        healthy = [
            *PRIVILEGED,
            f"cluster.image={self.image}",
            f"cluster.namespace={NAMESPACE}",
            f"kfp.host={self.kfp.url}",
            f"store.bucket={self.store_cfg.bucket}",
            f"store.endpoint={self.endpoint}",
            "store.timeout_s=10",
            "+cluster.env.NCCL_IB_HCA=mlx5",  # the guide's setting (issue 42, acceptance 1)
        ]
        return replaced(replaced(CLUSTER, *healthy), *extra)

    def __enter__(self):
        self.k8s.__enter__()
        self.kfp.__enter__()
        (self.tmp_path / "kubeconfig").write_text(self.k8s.kubeconfig())
        # where a kubeconfig is looked for ($KUBECONFIG is read once, when kubernetes is imported)
        location = str(self.tmp_path / "kubeconfig")
        self.monkeypatch.setattr("kubernetes.config.kube_config.KUBE_CONFIG_DEFAULT_LOCATION", location)
        return self

    def __exit__(self, *exc):
        self.stack.close()
        self.kfp.__exit__(*exc)
        self.k8s.__exit__(*exc)


@pytest.fixture
def cluster(tmp_path, monkeypatch, s3_env):
    monkeypatch.chdir(tmp_path)
    with Cluster(tmp_path, monkeypatch, s3_env) as c:
        yield c


def table_rows(out: str) -> dict[str, tuple[str, str, str]]:
    """The doctor's table as {check: (status, found, fix)}, cut at the header's columns."""
    lines = out.strip().splitlines()
    header = lines[0]
    assert header.split() == ["check", "status", "found", "fix"], header
    status_at, found_at, fix_at = (header.index(f" {word}") + 1 for word in ("status", "found", "fix"))
    rows = {}
    for line in lines[1:]:
        name = line[:status_at].strip()
        rows[name] = (line[status_at:found_at].strip(), line[found_at:fix_at].strip(), line[fix_at:].strip())
    return rows


def doctor(capsys, overrides: list[str]) -> tuple[int, dict[str, tuple[str, str, str]], list[str]]:
    rc = main(["doctor", *overrides])
    captured = capsys.readouterr()
    return rc, table_rows(captured.out), captured.err.splitlines()


def test_a_healthy_cluster_and_store_pass_every_row(cluster, capsys):
    """Acceptance (a): one row per check in order, none failing, exit 0, nothing on stderr; the
    probe leaves no object version behind in the bucket."""
    rc, rows, err = doctor(capsys, cluster.overrides())
    assert rc == 0 and err == [], err
    assert list(rows) == ROWS
    assert all(status in ("ok", "warn") for status, *_ in rows.values()), rows
    assert rows["kfp backend"][0] == "ok" and rows["kfp backend"][1].startswith(f"2.16.1 at {cluster.kfp.url}; ")
    assert "the pipeline needs >= 2.14.0" in rows["kfp backend"][1]
    assert rows["pod security"][1].startswith(
        f"namespace {NAMESPACE} enforces privileged; the replica pods need privileged"
    )
    assert rows["volcano"] == ("ok", "Volcano queue default is Open", "-")
    assert rows["nccl"][:2] == (
        "ok",
        "NCCL_IB_HCA=mlx5 selects 8 of 8 HCAs (ConnectX naming, one HCA per GPU "
        "(liftoff.dev/hcas overrides)); RDMA resources requested none, advertised none",
    )
    assert rows["gpu nodes"][1].startswith(
        "3 of 3 GPU nodes fit a replica (cpu 96, memory 745Gi, nvidia.com/gpu 8, ephemeral-storage 50Gi); "
        "room for 3 of 2 replicas"
    ), rows["gpu nodes"]
    assert (
        rows["store conditional writes"][0] == "ok"
        and "the probe object removed" in rows["store conditional writes"][1]
    )
    assert "free space is not reported by the S3 API" in rows["store capacity"][1]
    assert rows["image"][0] in ("ok", "warn") and "is this checkout's commit" in rows["image"][1]
    store = open_store(cluster.store_cfg, create=False)
    assert object_versions(store, "_doctor") == []
    assert ("", "namespaces", "get") in cluster.k8s.calls and ("", "nodes", "list") in cluster.k8s.calls
    assert ("scheduling.volcano.sh", "queues", "get") in cluster.k8s.calls


def test_a_version_free_healthz_is_read_off_the_ml_pipeline_deployment(cluster, capsys):
    """A backend before 2.16 reports no version on its healthz: the row reads the image tag of
    KFP's API server Deployment instead, and holds it to the pipeline's floor."""
    cluster.kfp.version = "unknown"
    rc, rows, _ = doctor(capsys, cluster.overrides())
    assert rc == 0 and rows["kfp backend"][0] == "ok"
    assert (
        "reports no version; its ml-pipeline Deployment runs ghcr.io/kubeflow/kfp-api-server:2.16.1"
        in (rows["kfp backend"][1])
    )
    cluster.k8s.deployments[("kubeflow", "ml-pipeline")] = "ghcr.io/kubeflow/kfp-api-server:2.5.0"
    rc, rows, err = doctor(capsys, cluster.overrides())
    assert rc == 2 and rows["kfp backend"][0] == "FAIL" and "is 2.5.0; this pipeline needs >= 2.14.0" in err[0]


def _baseline_namespace(c: Cluster) -> list[str]:
    c.k8s.namespaces[NAMESPACE] = {ENFORCE_LABEL: "baseline"}
    return []


def _small_nodes(c: Cluster) -> list[str]:
    c.k8s.nodes = [gpu_node("gpu-0"), gpu_node("gpu-1", memory="512Gi"), gpu_node("gpu-2", memory="512Gi")]
    return []


def _seaweedfs(c: Cluster) -> list[str]:
    proxy = c.stack.enter_context(SeaweedfsProxy(c.endpoint))
    return [f"store.endpoint={proxy.endpoint}"]


def _closed_queue(c: Cluster) -> list[str]:
    c.k8s.queues["default"] = "Closed"
    return []


def _old_backend(c: Cluster) -> list[str]:
    c.kfp.version = "2.5.0"
    return []


def _other_commit(c: Cluster) -> list[str]:
    return ["cluster.image=registry.example.com/liftoff:" + ("a" if code_version()[0] != "a" else "b") * 10]


def _full_disk(c: Cluster) -> list[str]:
    """The local backend reports free space: 1 MiB left under store.root."""
    usage = namedtuple("usage", "total used free")
    c.monkeypatch.setattr("pipelines.doctor.shutil.disk_usage", lambda _: usage(2**40, 2**40 - 2**20, 2**20))
    (c.tmp_path / "store").mkdir()
    return ["store=local", f"store.root={c.tmp_path / 'store'}"]


def _exact_hca(c) -> list[str]:
    return ["+cluster.env.NCCL_IB_HCA='=mlx5'"]  # round 2's guide: exact names, none is `mlx5`


UNHEALTHY = {
    "pod security": (
        _baseline_namespace,
        f"liftoff doctor: pod security: namespace {NAMESPACE} enforces baseline; the replica pods need privileged "
        "(train and preflight: Capabilities: container worker-0 adds IPC_LOCK, HostPath Volumes: nvme)",
        f"fix: kubectl label namespace {NAMESPACE} {ENFORCE_LABEL}=privileged --overwrite",
    ),
    "gpu nodes": (
        _small_nodes,
        "liftoff doctor: gpu nodes: 1 of 3 GPU nodes fit a replica (cpu 96, memory 745Gi, nvidia.com/gpu 8, "
        "ephemeral-storage 50Gi); room for 1 of 2 replicas: gpu-1: memory 512Gi < 745Gi; gpu-2: memory 512Gi < 745Gi",
        "lower cluster.mem_mb",
    ),
    "store conditional writes": (
        _seaweedfs,
        "liftoff doctor: store conditional writes: MinIO endpoint 127.0.0.1:",
        "a second If-None-Match: * create succeeded over an existing object",
    ),
    "volcano": (_closed_queue, "liftoff doctor: volcano: Volcano queue default is Closed", "vcctl queue operate"),
    "kfp backend": (_old_backend, "liftoff doctor: kfp backend: Kubeflow Pipelines at http://", "is 2.5.0"),
    "image": (_other_commit, "liftoff doctor: image: registry.example.com/liftoff:", "the pods would run other code"),
    "store capacity": (_full_disk, "liftoff doctor: store capacity: 1 MiB free under ", "train.checkpoint_keep"),
    "nccl": (
        _exact_hca,
        "liftoff doctor: nccl: NCCL_IB_HCA==mlx5 selects none of mlx5_0, mlx5_1, mlx5_2, mlx5_3, mlx5_4, mlx5_5, "
        "mlx5_6, mlx5_7 (ConnectX naming",
        "NCCL falls back to TCP sockets",
    ),
}


@pytest.mark.parametrize("row", list(UNHEALTHY), ids=lambda row: row.replace(" ", "-"))
def test_each_unhealthy_fact_alone_fails_its_row_in_one_line(cluster, capsys, row):
    """Acceptance (b): the table still has every row, only this one FAILs; stderr is exactly one
    line naming it, with what was found and the fix; exit 2."""
    make, starts, says = UNHEALTHY[row]
    rc, rows, err = doctor(capsys, cluster.overrides(*make(cluster)))
    assert rc == 2 and len(err) == 1, err
    assert list(rows) == ROWS and [name for name, (status, *_) in rows.items() if status == "FAIL"] == [row], rows
    assert err[0].startswith(starts) and says in err[0], err[0]
    assert "; fix: " in err[0] and " | " not in err[0]


def test_the_gpu_nodes_row_names_why_each_node_does_not_fit(cluster, capsys):
    """Kubernetes quantities read as the scheduler reads them (800000M of memory is 745Gi, 95500m
    of CPU is 95.5), the node selector's GPU product, untolerated taints, a cordoned node and an
    extra resource (RDMA) each keep a replica off; a node without GPUs is no GPU node."""
    cordoned = gpu_node("gpu-5", rdma__ib="1")
    cordoned["spec"]["unschedulable"] = True
    cluster.k8s.nodes = [
        gpu_node("gpu-0", memory="800000M", rdma__ib="2"),  # exactly one replica's memory; room for 1
        gpu_node("gpu-1", cpu="95500m", rdma__ib="1"),
        gpu_node("gpu-2", product="NVIDIA-H100-80GB-HBM3", rdma__ib="1"),
        gpu_node(
            "gpu-3", rdma__ib="1", taints=[{"key": "liftoff.dev/unhealthy", "value": "true", "effect": "NoSchedule"}]
        ),
        gpu_node("gpu-4", ephemeral="40Gi", memory="780Gi", rdma__ib="1"),
        cordoned,
        gpu_node("gpu-6", taints=[{"key": "soft", "effect": "PreferNoSchedule"}]),
        gpu_node("cpu-0", gpus=0),
    ]
    rc, rows, err = doctor(capsys, cluster.overrides("+cluster.extra_resources={rdma/ib:1}"))
    assert rc == 2 and rows["gpu nodes"][0] == "FAIL"
    assert rows["gpu nodes"][1] == (
        "1 of 7 GPU nodes fit a replica (cpu 96, memory 745Gi, nvidia.com/gpu 8, rdma/ib 1, ephemeral-storage 50Gi); "
        "room for 1 of 2 replicas: gpu-1: cpu 95.5 < 96.0; gpu-2: nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3, not "
        "NVIDIA-H200; gpu-3: taint liftoff.dev/unhealthy=true:NoSchedule; gpu-4: ephemeral-storage 40Gi < 50Gi; "
        "and 2 more"
    ), rows["gpu nodes"][1]
    assert rows["gpu nodes"][2] == (
        "nodes with that much allocatable (kubectl describe node), fewer cluster.nodes, or lower cluster.cpu, "
        "cluster.ephemeral_storage_gb, cluster.extra_resources"
    ), rows["gpu nodes"][2]


def test_the_seaweedfs_row_names_the_step_and_the_fix(cluster, capsys):
    with SeaweedfsProxy(cluster.endpoint) as proxy:
        rc, rows, err = doctor(capsys, cluster.overrides(f"store.endpoint={proxy.endpoint}"))
    assert rc == 2
    assert err[0].endswith(
        "a second If-None-Match: * create succeeded over an existing object: the store ignores If-None-Match, so "
        "two runs of one training identity could both take its lease; fix: a store whose conditional writes work: "
        "MinIO (2024 or later), S3, or SeaweedFS >= 4.08 (before it, a versioned bucket ignores If-None-Match and "
        "refuses every If-Match: seaweedfs#8073)"
    ), err[0]
    assert [put["if-none-match"] for put in proxy.seen if "if-none-match" in put] == ["*", "*"]  # the probe asked
    assert proxy.forwarded and not any("if-none-match" in put for put in proxy.forwarded)  # moto never saw it
    store = open_store(cluster.store_cfg, create=False)
    assert object_versions(store, "_doctor") == []  # the probe cleaned up behind the failing step


def test_unreachable_apis_are_failing_rows_not_tracebacks(tmp_path, monkeypatch, capsys, s3_env):
    """No kubeconfig, nothing on the KFP port, no bucket: every row that needs one fails saying so."""
    from tests.conftest import free_port

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("kubernetes.config.kube_config.KUBE_CONFIG_DEFAULT_LOCATION", str(tmp_path / "none"))
    image = f"cluster.image=registry.example.com/liftoff:{short_commit(code_version())}"
    overrides = replaced(CLUSTER, image, f"kfp.host=http://127.0.0.1:{free_port()}", "store.bucket=no-such-bucket")
    rc, rows, err = doctor(capsys, overrides)
    assert rc == 2 and len(err) == 1
    failing = [name for name, (status, *_) in rows.items() if status == "FAIL"]
    assert failing == ["kfp backend", "pod security", "volcano", "gpu nodes", "nccl", "store conditional writes"]
    assert "cannot reach the Kubernetes API: ConfigException" in rows["volcano"][1]
    assert "store.bucket=no-such-bucket: no artifact store there" in rows["store conditional writes"][1]
    assert all(f"{name}: " in err[0] for name in failing) and "Traceback" not in err[0]


# -- submit and upload ------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["submit", "upload"])
def test_submit_and_upload_refuse_an_unhealthy_cluster_before_any_kfp_call(cluster, capsys, command):
    """Acceptance (c): the namespace would refuse the replicas; nothing reaches KFP (no healthz,
    no experiment, no upload, no run), and the one line names the row and how to see the rest."""
    cluster.k8s.namespaces[NAMESPACE] = {ENFORCE_LABEL: "baseline"}
    assert main([command, *cluster.overrides()]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"liftoff {command}: pod security: namespace {NAMESPACE} enforces")
    assert err[0].endswith("(liftoff doctor shows every check; --skip-doctor skips them)")
    assert cluster.kfp.requests == [] and cluster.kfp.runs == []
    assert ("", "namespaces", "get") in cluster.k8s.calls  # the doctor looked


def test_skip_doctor_submits_and_the_run_name_says_so(cluster, capsys):
    cluster.k8s.namespaces[NAMESPACE] = {ENFORCE_LABEL: "baseline"}
    assert main(["submit", "--skip-doctor", *cluster.overrides()]) == 0
    (run,) = cluster.kfp.runs
    assert run["display_name"].startswith("liftoff cluster=kubernetes") and run["display_name"].endswith(DOCTOR_SKIPPED)
    assert cluster.k8s.calls == []  # no check ran


def test_a_healthy_submit_runs_the_doctor_and_its_run_name_is_plain(cluster, capsys):
    assert main(["submit", *cluster.overrides()]) == 0
    (run,) = cluster.kfp.runs
    assert not run["display_name"].endswith(DOCTOR_SKIPPED)
    assert ("", "nodes", "list") in cluster.k8s.calls
    assert capsys.readouterr().err == ""


# -- the lease, which the conditional-writes row stands for (acceptance 5) ------------------------------------


def test_a_held_lease_survives_three_renewals_on_a_store_the_doctor_passes(cluster, capsys):
    """Against plain moto the doctor's probe passes and a lease's heartbeat renews it (three times
    here, every ttl/3)."""
    rc, rows, _ = doctor(capsys, cluster.overrides())
    assert rc == 0 and rows["store conditional writes"][0] == "ok"
    store = open_store(cluster.store_cfg, create=False)
    lease = Lease(store, "3f2a9c0d11aa4b5c", "node-a:1", ttl_s=1.5)
    with lease.hold():
        deadline = time.monotonic() + 20
        while lease._renewals < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        lease.check()
        assert lease._renewals >= 3 and lease.held
        record = json.loads(store.backend.get_bytes(lease.key))
        assert record["token"] == lease.token and not record["released"]


def test_on_seaweedfs_before_4_08_the_doctor_refuses_what_would_lose_the_lease(cluster, capsys):
    """Acceptance 5: through the SeaweedFS proxy the doctor refuses, and rightly: a lease taken
    there is lost at its first heartbeat (If-Match always 412), and a second holder takes a
    live lease too (If-None-Match ignored)."""
    with SeaweedfsProxy(cluster.endpoint) as proxy:
        rc, rows, err = doctor(capsys, cluster.overrides(f"store.endpoint={proxy.endpoint}"))
        assert rc == 2 and rows["store conditional writes"][0] == "FAIL"
        assert err[0].startswith("liftoff doctor: store conditional writes: ")
        store = open_store(store_config_at(cluster, proxy.endpoint), create=False)
        lease = Lease(store, "3f2a9c0d11aa4b5c", "node-a:1", ttl_s=3.0)
        with lease.hold():
            deadline = time.monotonic() + 20
            while lease.lost is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert isinstance(lease.lost, LeaseLost) and lease._renewals == 0
            second = Lease(store, "3f2a9c0d11aa4b5c", "node-b:2", ttl_s=60).acquire()  # over a live lease
            assert second.held


def store_config_at(c: Cluster, endpoint: str):
    import dataclasses

    return dataclasses.replace(c.store_cfg, endpoint=endpoint)
