"""Issue 42, acceptance 3: the replica pods `liftoff render` writes for the guide's run are checked
against the Kubernetes Pod Security Standards (tests/pod_security.py, from the published
baseline and restricted controls). The guide's replicas mount the node's NVMe by hostPath and add
IPC_LOCK for RDMA: they need the `privileged` level, which KFP 2.16's `kubeflow` namespace
(labelled `baseline`) refuses, so Volcano could create no replica pod and the gang waited
`pending_timeout_s`. deploy/README.md labels the namespace the runs execute in with the level the
rendered pods need; without the hostPath and the capability `baseline` admits them."""

from __future__ import annotations

import copy

import pytest
import yaml

from pipelines.cli import main
from tests import guide
from tests.pod_security import ENFORCE_LABEL, LEVELS, needed, violations

HUB_REVISION = "0" * 40
FABRIC_PREFIXES = ("+cluster.extra_resources=", "cluster.capabilities=", "+cluster.pod_annotations=", "+cluster.env=")


def _guide_overrides() -> list[str]:
    """The guide's OVERRIDES array, its placeholders filled in."""
    words = [w.replace("$IMAGE", "registry.example.com/liftoff:0123456789") for w in guide.overrides()]
    return [w.replace("$FINEWEB_REVISION", HUB_REVISION) for w in words]


def _render(tmp_path, monkeypatch, overrides: list[str]) -> list[dict]:
    """Every replica pod (metadata and spec) of the rendered train and preflight jobs."""
    monkeypatch.chdir(tmp_path)
    assert main(["render", *overrides]) == 0
    pods = []
    for job in ("train", "preflight"):
        rendered = yaml.safe_load((tmp_path / "build" / "jobs" / f"{job}.yaml").read_text())
        pods += [{"job": job, **task["template"]} for task in rendered["spec"]["tasks"]]
    assert pods
    return pods


@pytest.fixture(scope="module")
def guide_pods(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        return _render(tmp_path_factory.mktemp("guide"), mp, _guide_overrides())


def _guide_level() -> tuple[str, list[str]]:
    """The level deploy/README.md's `kubectl label namespace ...` enforces, and the command."""
    labels = [
        c
        for c in guide.commands()
        if c[:3] in (["kubectl", "label", "namespace"], ["kubectl", "label", "ns"])
        and any(w.startswith(f"{ENFORCE_LABEL}=") for w in c)
    ]
    assert len(labels) == 1, f"deploy/README.md labels a namespace's enforce level {len(labels)} times: {labels}"
    (command,) = labels
    (level,) = [w.partition("=")[2] for w in command if w.startswith(f"{ENFORCE_LABEL}=")]
    return level, command


def test_the_rendered_replicas_of_the_guide_need_privileged_for_hostpath_and_ipc_lock(guide_pods):
    """The level the guide's replicas need, and exactly why baseline refuses them."""
    for pod in guide_pods:
        assert needed(pod) == "privileged", pod["job"]
        assert violations(pod, "baseline") == [
            f"Capabilities: container {pod['spec']['containers'][0]['name']} adds IPC_LOCK",
            "HostPath Volumes: nvme",
        ], pod["job"]


def test_the_guide_labels_the_runs_namespace_with_a_level_that_admits_the_rendered_replicas(guide_pods):
    """The namespace the guide labels is the one the replicas are created in ($NS: the guide leaves
    cluster.namespace null, so the run's own namespace), with --overwrite (KFP 2.16 labels
    `kubeflow` baseline); the level admits every rendered replica and baseline, KFP's label,
    would not: the instruction is needed."""
    level, command = _guide_level()
    assert level in LEVELS, command
    assert "$NS" in command and "--overwrite" in command, command
    assert not any(w.startswith("cluster.namespace=") for w in guide.overrides())
    for pod in guide_pods:
        assert not violations(pod, level), (command, violations(pod, level))
        assert violations(pod, "baseline"), pod["job"]


def test_without_the_hostpath_and_the_capability_baseline_admits_the_replicas(tmp_path, monkeypatch):
    """What the guide tells a cluster without RDMA or node NVMe: its replicas need no more than
    baseline (the level KFP 2.16 gives `kubeflow`); no configuration meets restricted (liftoff sets
    no runAsNonRoot, seccomp profile or allowPrivilegeEscalation=false on the replicas)."""
    plain = [
        w
        for w in _guide_overrides()
        if not w.startswith(FABRIC_PREFIXES) and not w.startswith(("cluster.volumes=", "train.checkpoint_dir="))
    ]
    for pod in _render(tmp_path, monkeypatch, plain):
        assert needed(pod) == "baseline", (pod["job"], violations(pod, "baseline"))


def _hardened() -> dict:
    container = {
        "name": "c",
        "image": "i",
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "runAsNonRoot": True,
            "seccompProfile": {"type": "RuntimeDefault"},
            "capabilities": {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]},
        },
    }
    return {"metadata": {}, "spec": {"containers": [container], "volumes": [{"name": "v", "emptyDir": {}}]}}


def _set(pod: dict, path: str, value) -> dict:
    pod = copy.deepcopy(pod)
    node = pod
    *keys, last = path.split(".")
    for key in keys:
        node = node[int(key)] if isinstance(node, list) else node.setdefault(key, {})
    node[last] = value
    return pod


@pytest.mark.parametrize(
    "path, value, level",
    [
        ("spec.hostNetwork", True, "privileged"),
        ("spec.hostPID", True, "privileged"),
        ("spec.hostIPC", True, "privileged"),
        ("spec.volumes", [{"name": "h", "hostPath": {"path": "/mnt"}}], "privileged"),
        ("spec.containers.0.securityContext.privileged", True, "privileged"),
        ("spec.containers.0.securityContext.capabilities.add", ["IPC_LOCK"], "privileged"),
        ("spec.containers.0.securityContext.capabilities.add", ["SYS_ADMIN"], "privileged"),
        ("spec.containers.0.securityContext.capabilities.add", ["NET_RAW"], "privileged"),
        ("spec.containers.0.ports", [{"containerPort": 80, "hostPort": 80}], "privileged"),
        ("spec.containers.0.securityContext.seccompProfile", {"type": "Unconfined"}, "privileged"),
        ("spec.containers.0.securityContext.procMount", "Unmasked", "privileged"),
        ("spec.securityContext.sysctls", [{"name": "kernel.msgmax", "value": "1"}], "privileged"),
        ("spec.securityContext.seLinuxOptions", {"type": "spc_t"}, "privileged"),
        ("metadata.annotations", {"container.apparmor.security.beta.kubernetes.io/c": "unconfined"}, "privileged"),
        ("spec.containers.0.securityContext.capabilities.add", ["CHOWN"], "baseline"),
        ("spec.containers.0.securityContext.capabilities.drop", [], "baseline"),
        ("spec.containers.0.securityContext.allowPrivilegeEscalation", True, "baseline"),
        ("spec.containers.0.securityContext.runAsNonRoot", False, "baseline"),
        ("spec.containers.0.securityContext.runAsUser", 0, "baseline"),
        ("spec.containers.0.securityContext.seccompProfile", {}, "baseline"),
        ("spec.volumes", [{"name": "n", "nfs": {"server": "s", "path": "/"}}], "baseline"),
        ("spec.securityContext.sysctls", [{"name": "net.ipv4.tcp_syncookies", "value": "1"}], "restricted"),
        ("spec.volumes", [{"name": "p", "persistentVolumeClaim": {"claimName": "c"}}], "restricted"),
    ],
)
def test_the_checker_applies_the_published_controls(path, value, level):
    """One change to a pod that meets restricted, and the strictest level that still admits it."""
    assert needed(_hardened()) == "restricted"
    assert needed(_set(_hardened(), path, value)) == level
