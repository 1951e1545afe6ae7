"""What a cluster run would create, checked without a cluster: `liftoff render` writes the
compiled pipeline and TorchX's own Kubernetes dry run of the train and preflight jobs; they
are parsed strictly against the real schemas (kfp-pipeline-spec protos, Volcano's Job CRD,
the Kubernetes OpenAPI via kubernetes-validate), and deploy/ grants every API call the code
makes to the service account the pods run as."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from components import k8s
from pipelines.cli import main
from tests.conftest import S3_ACCESS_KEY, S3_SECRET_KEY

ROOT = Path(__file__).resolve().parents[2]
VOLCANO_CRD = ROOT / "tests" / "schemas" / "batch.volcano.sh_jobs.yaml"
K8S_VERSION = "1.30"
CLUSTER = [
    "cluster=kubernetes",
    "store=minio",
    "cluster.nodes=2",
    "cluster.image=registry.example.com/liftoff:0123456789",
    "+cluster.node_selector={nvidia.com/gpu.product:NVIDIA-H200}",
]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    import os

    tmp = tmp_path_factory.mktemp("render")
    cwd = os.getcwd()
    os.chdir(tmp)
    try:
        assert main(["render", *CLUSTER]) == 0
    finally:
        os.chdir(cwd)
    build = tmp / "build"
    return {
        "pipeline": list(yaml.safe_load_all((build / "pretrain.yaml").read_text())),
        "train": yaml.safe_load((build / "jobs" / "train.yaml").read_text()),
        "preflight": yaml.safe_load((build / "jobs" / "preflight.yaml").read_text()),
        "text": "".join(p.read_text() for p in build.rglob("*.yaml")),
    }


def _strict(schema: dict) -> dict:
    """The CRD's structural schema as JSON Schema that rejects unknown fields."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if node.pop("x-kubernetes-int-or-string", False):
                node.pop("type", None)
                node["anyOf"] = [{"type": "integer"}, {"type": "string"}]
            if "properties" in node and not node.get("x-kubernetes-preserve-unknown-fields"):
                node.setdefault("additionalProperties", False)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


def _volcano_validator():
    import jsonschema

    crd = yaml.safe_load(VOLCANO_CRD.read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1")
    return jsonschema.Draft7Validator(_strict(version["schema"]["openAPIV3Schema"]))


@pytest.mark.parametrize("job", ["train", "preflight"])
def test_rendered_volcano_jobs_pass_the_crd_schema_strictly(rendered, job):
    validator = _volcano_validator()
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(rendered[job])]
    assert not errors, errors
    bad = copy.deepcopy(rendered[job])
    bad["spec"]["tasks"][0]["template"]["spec"]["nodeSelectr"] = {}  # a typo must not pass
    assert list(validator.iter_errors(bad))


@pytest.mark.parametrize("job", ["train", "preflight"])
def test_rendered_pods_pass_the_kubernetes_schema(rendered, job):
    import kubernetes_validate

    for task in rendered[job]["spec"]["tasks"]:
        pod = {"apiVersion": "v1", "kind": "Pod", **task["template"]}
        pod["metadata"] = {"name": task["name"], **pod.get("metadata", {})}
        kubernetes_validate.validate(pod, K8S_VERSION, strict=True)


def test_preflight_runs_one_process_per_device_like_training():
    import re

    from omegaconf import OmegaConf

    from components.config import compose
    from components.launcher import kubernetes_job
    from components.preflight.stage import preflight_launch
    from components.train.stage import train_launch

    cfg = OmegaConf.to_object(compose([*CLUSTER, "cluster.namespace=team-a", "cluster.procs_per_node=8"]))
    _, _, train = train_launch("dataset/d@v", cfg.model, cfg.train, cfg.cluster, cfg.store, cache_gb=cfg.data.cache_gb)
    preflight = preflight_launch("dataset/d@v", cfg.train, cfg.cluster, cfg.preflight, cfg.store)

    def nproc(launch) -> set[str]:
        job = k8s.as_plain(kubernetes_job(launch, {"LIFTOFF_ATTEMPT": "0"}, namespace="team-a").request.resource)
        return {m for c in _containers(job) for m in re.findall(r"--nproc_per_node\s+(\d+)", " ".join(c["command"]))}

    assert nproc(preflight) == nproc(train) == {"8"}


def test_train_job_stays_off_the_nodes_preflight_excluded():
    """The verdict's excluded hosts become a required node anti-affinity on every replica,
    valid against the Volcano CRD and the Kubernetes schema."""
    import kubernetes_validate
    from omegaconf import OmegaConf

    from components.config import compose
    from components.launcher import kubernetes_job
    from components.train.stage import train_launch

    cfg = OmegaConf.to_object(compose([*CLUSTER, "cluster.namespace=team-a"]))
    _, _, launch = train_launch(
        "dataset/d@v", cfg.model, cfg.train, cfg.cluster, cfg.store, ["gpu-node-7"], cache_gb=cfg.data.cache_gb
    )
    job = k8s.as_plain(kubernetes_job(launch, {"LIFTOFF_ATTEMPT": "0"}, namespace="team-a").request.resource)
    assert not list(_volcano_validator().iter_errors(job))
    for task in job["spec"]["tasks"]:
        terms = task["template"]["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        away = terms["nodeSelectorTerms"][0]["matchFields"]
        assert away == [{"key": "metadata.name", "operator": "NotIn", "values": ["gpu-node-7"]}]
        pod = {"apiVersion": "v1", "kind": "Pod", **task["template"]}
        pod["metadata"] = {"name": task["name"], **pod.get("metadata", {})}
        kubernetes_validate.validate(pod, K8S_VERSION, strict=True)


def test_a_job_owned_by_its_driver_pod_passes_the_schemas(tmp_path, monkeypatch):
    """In a KFP pod (KFP_POD_NAME/KFP_POD_UID from the downward API) the vcjob carries an
    ownerReference to it, the launch and attempt labels and a name of its own per attempt;
    still valid against the Volcano CRD, its metadata against Kubernetes' ObjectMeta, and
    every pod name within the 63 characters finish_job checks."""
    import kubernetes_validate
    from omegaconf import OmegaConf

    from components.config import compose
    from components.launcher import kubernetes_job
    from components.train.stage import train_launch

    (tmp_path / "namespace").write_text("team-a\n")
    monkeypatch.setattr(k8s, "IN_CLUSTER_NAMESPACE", tmp_path / "namespace")
    monkeypatch.setenv("KFP_POD_NAME", "pretrain-abcde-system-container-impl-1234567890")
    monkeypatch.setenv("KFP_POD_UID", "0b6e8f0e-3c1a-4a4e-9d57-1f1e6f0c2a11")
    cfg = OmegaConf.to_object(compose([*CLUSTER, "cluster.namespace=team-a", "cluster.nodes=16"]))
    _, _, launch = train_launch("dataset/d@v", cfg.model, cfg.train, cfg.cluster, cfg.store, cache_gb=cfg.data.cache_gb)
    job = k8s.as_plain(kubernetes_job(launch, {"LIFTOFF_ATTEMPT": "12"}, namespace="team-a").request.resource)
    assert not list(_volcano_validator().iter_errors(job))
    meta = job["metadata"]
    owner = {"apiVersion": "v1", "kind": "Pod", "name": "pretrain-abcde-system-container-impl-1234567890"}
    assert meta["ownerReferences"] == [{**owner, "uid": "0b6e8f0e-3c1a-4a4e-9d57-1f1e6f0c2a11"}]
    assert meta["labels"][k8s.LAUNCH_LABEL] == launch.launch_id and meta["labels"][k8s.ATTEMPT_LABEL] == "12"
    assert meta["name"].startswith(f"{launch.name}-{launch.launch_id[-8:]}-a12-")
    kubernetes_validate.validate({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta}, K8S_VERSION, strict=True)
    for task in job["spec"]["tasks"]:
        assert task["template"]["metadata"]["labels"][k8s.LAUNCH_LABEL] == launch.launch_id
        assert len(f"{meta['name']}-{task['name']}-0") <= 63
    # a job in another namespace than the driver's is not owned: the garbage collector would
    # look for the owner in the job's namespace, not find it, and delete the job at once
    other = k8s.as_plain(kubernetes_job(launch, {"LIFTOFF_ATTEMPT": "0"}, namespace="team-b").request.resource)
    assert "ownerReferences" not in other["metadata"]


def test_deploy_manifests_pass_the_kubernetes_schema():
    import kubernetes_validate

    for path in sorted((ROOT / "deploy").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_compiled_pipeline_parses_strictly_into_pipeline_and_platform_specs(rendered):
    from google.protobuf import json_format
    from kfp.kubernetes import kubernetes_executor_config_pb2
    from kfp.pipeline_spec import pipeline_spec_pb2

    pipeline, platform = rendered["pipeline"]
    json_format.ParseDict(pipeline, pipeline_spec_pb2.PipelineSpec(), ignore_unknown_fields=False)
    json_format.ParseDict(platform, pipeline_spec_pb2.PlatformSpec(), ignore_unknown_fields=False)
    for executor in platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"].values():
        config = kubernetes_executor_config_pb2.KubernetesExecutorConfig()
        json_format.ParseDict(executor, config, ignore_unknown_fields=False)


def _containers(job: dict) -> list[dict]:
    return [c for task in job["spec"]["tasks"] for c in task["template"]["spec"]["containers"]]


@pytest.mark.parametrize("job", ["train", "preflight"])
def test_replicas_get_store_keys_by_secret_reference_and_their_node_name(rendered, job):
    """Findings 2 and 6: the keys reach every replica from the Secret (no literal value in the
    vcjob), and NODE_NAME is the Kubernetes node the pod landed on."""
    for container in _containers(rendered[job]):
        env = {e["name"]: e for e in container["env"]}
        for name, key in k8s.STORE_SECRET_KEYS.items():
            assert "value" not in env[name]
            assert env[name]["valueFrom"]["secretKeyRef"] == {"name": "liftoff-minio", "key": key}
        assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
        assert container["imagePullPolicy"] == "Always"
        assert container["image"] == "registry.example.com/liftoff:0123456789"
    assert S3_SECRET_KEY not in rendered["text"] and S3_ACCESS_KEY not in rendered["text"]


def test_gpu_placement_is_on_the_replicas_not_on_the_cpu_only_kfp_pods(rendered):
    """Finding 5: TorchX ignored our node selector, and the KFP pods got the GPU toleration."""
    for task in rendered["train"]["spec"]["tasks"]:
        spec = task["template"]["spec"]
        assert spec["nodeSelector"]["nvidia.com/gpu.product"] == "NVIDIA-H200"
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
        assert spec["serviceAccountName"] == k8s.SERVICE_ACCOUNT
    executors = rendered["pipeline"][1]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    for executor in executors.values():
        assert "tolerations" not in executor and "nodeSelector" not in executor


def _granted(docs: list[dict], account: str) -> set[tuple[str, str, str]]:
    roles = {(d["kind"], d["metadata"]["name"]): d for d in docs if d["kind"] in ("Role", "ClusterRole")}
    granted = set()
    for binding in (d for d in docs if d["kind"] in ("RoleBinding", "ClusterRoleBinding")):
        if not any(s["kind"] == "ServiceAccount" and s["name"] == account for s in binding["subjects"]):
            continue
        role = roles[(binding["roleRef"]["kind"], binding["roleRef"]["name"])]
        for rule in role["rules"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    granted |= {(group, resource, verb) for verb in rule["verbs"]}
    return granted


def test_deploy_grants_exactly_the_calls_the_code_lists_to_the_account_pods_run_as():
    """Finding 7: one service account, and every call in components/k8s.py is granted to it
    (jobs/status included); deploy/ grants nothing the code does not list."""
    from components.config import compose

    docs = list(yaml.safe_load_all((ROOT / "deploy" / "rbac.yaml").read_text()))
    granted = _granted(docs, k8s.SERVICE_ACCOUNT)
    needed = {(a.group, a.resource, a.verb) for a in k8s.ACCESS}
    assert needed - granted == set(), f"not granted: {sorted(needed - granted)}"
    assert granted - needed == set(), f"granted but never used: {sorted(granted - needed)}"
    cfg = compose(["cluster=kubernetes"])
    assert cfg.cluster.service_account == k8s.SERVICE_ACCOUNT == cfg.kfp.service_account


def test_every_kubernetes_call_a_cluster_run_makes_is_granted(tmp_path, monkeypatch):
    """A train launch on the kubernetes scheduler against a loopback API server: TorchX's own
    calls (create, status, pods, logs) and liftoff's (find and delete an earlier attempt's
    job) are recorded as (apiGroup, resource, verb), and deploy/rbac.yaml grants each one to
    the service account the pods run as. The earlier attempt's job is deleted first."""
    from components.config import Scheduler, defaults
    from components.launcher import run_once
    from tests.pipeline.fake_k8s import FakeK8s, train_launch_on

    docs = list(yaml.safe_load_all((ROOT / "deploy" / "rbac.yaml").read_text()))
    granted = _granted(docs, k8s.SERVICE_ACCOUNT)
    cluster = defaults(
        "cluster", scheduler=Scheduler.kubernetes, nodes=2, namespace="team-a", image="registry.example.com/liftoff:1"
    )
    launch = train_launch_on(cluster, tmp_path)
    with FakeK8s(earlier_jobs=["train-abc-old1"]) as api:  # this launch's attempt 0, left running
        labels = {k8s.JOB_LABEL: "train-abc", k8s.LAUNCH_LABEL: launch.launch_id, k8s.ATTEMPT_LABEL: "0"}
        api.jobs["train-abc-old1"]["metadata"]["labels"] = labels
        (tmp_path / "kubeconfig").write_text(api.kubeconfig())
        # where a kubeconfig is looked for ($KUBECONFIG is read once, when kubernetes is imported)
        monkeypatch.setattr("kubernetes.config.kube_config.KUBE_CONFIG_DEFAULT_LOCATION", str(tmp_path / "kubeconfig"))
        run_once(launch, {"LIFTOFF_ATTEMPT": "1"})
        quarantine = __import__("components.preflight.quarantine", fromlist=["quarantine_nodes"])
        from kubernetes import client, config

        config.load_kube_config(config_file=str(tmp_path / "kubeconfig"))
        quarantine.quarantine_nodes(["gpu-node-7"], {"gpu-node-7": ["slow GEMM"]}, api=client.CoreV1Api())
    assert api.deleted[0] == "train-abc-old1"
    created = [job for name, job in api.jobs.items() if name != "train-abc-old1"]
    assert created and created[0]["metadata"]["labels"][k8s.JOB_LABEL] == "train-abc"
    assert created[0]["metadata"]["labels"][k8s.ATTEMPT_LABEL] == "1"
    calls = set(api.calls)
    for needed in [
        ("batch.volcano.sh", "jobs", "create"),
        ("batch.volcano.sh", "jobs", "list"),
        ("batch.volcano.sh", "jobs", "delete"),
        ("batch.volcano.sh", "jobs/status", "get"),
        ("", "pods/log", "get"),
        ("", "nodes", "patch"),
    ]:
        assert needed in calls, f"the run never made {needed}: the fake recorded {sorted(calls)}"
    assert calls <= granted, f"made but not granted by deploy/rbac.yaml: {sorted(calls - granted)}"
    listed = {(a.group, a.resource, a.verb) for a in k8s.ACCESS}
    assert calls <= listed, f"made but not listed in components/k8s.py: {sorted(calls - listed)}"
