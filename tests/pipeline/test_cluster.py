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
from tests.helpers import CLUSTER

ROOT = Path(__file__).resolve().parents[2]
VOLCANO_CRD = ROOT / "tests" / "schemas" / "batch.volcano.sh_jobs.yaml"
K8S_VERSION = "1.30"
# the fabric and disks of an RDMA cluster, and a private registry: rendered into every object
FABRIC = [
    "cluster.image_pull_secrets=[regcred]",
    "+cluster.extra_resources={rdma/rdma_shared_device_a:1}",
    "cluster.capabilities=[IPC_LOCK]",
    "+cluster.pod_annotations={k8s.v1.cni.cncf.io/networks:rdma-net}",
    "+cluster.env={NCCL_IB_HCA:'=mlx5_0',NCCL_SOCKET_IFNAME:eth0}",
    "cluster.volumes=[{name:scratch,mount_path:/scratch,kind:hostPath,host_path:/mnt/nvme},"
    "{name:spill,mount_path:/spill,kind:emptyDir,size_gb:100},{name:shared,mount_path:/shared,kind:pvc,claim_name:ckpt}]",
    "train.checkpoint_dir=/scratch/checkpoints",
    "store.cache_dir=/scratch/cache",
    "train.metrics_port=9400",
]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    import os

    tmp = tmp_path_factory.mktemp("render")
    cwd = os.getcwd()
    os.chdir(tmp)
    try:
        assert main(["render", *CLUSTER, *FABRIC]) == 0
    finally:
        os.chdir(cwd)
    build = tmp / "build"
    return {
        "pipeline": list(yaml.safe_load_all((build / "pretrain.yaml").read_text())),
        "train": yaml.safe_load((build / "jobs" / "train.yaml").read_text()),
        "preflight": yaml.safe_load((build / "jobs" / "preflight.yaml").read_text()),
        "policy": yaml.safe_load((build / "networkpolicy.yaml").read_text()),
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
    preflight = preflight_launch("dataset/d@v", cfg.model, cfg.train, cfg.cluster, cfg.preflight, cfg.store)

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
        assert (
            spec["serviceAccountName"] == k8s.REPLICA_SERVICE_ACCOUNT and spec["automountServiceAccountToken"] is False
        )
    executors = rendered["pipeline"][1]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    for executor in executors.values():
        assert "tolerations" not in executor and "nodeSelector" not in executor


def _granted(docs: list[dict], account: str, names: bool = False) -> set[tuple]:
    """(apiGroup, resource, verb) the account is granted; with `names`, each with the
    resourceNames it is limited to (() for any object)."""
    roles = {(d["kind"], d["metadata"]["name"]): d for d in docs if d["kind"] in ("Role", "ClusterRole")}
    granted = set()
    for binding in (d for d in docs if d["kind"] in ("RoleBinding", "ClusterRoleBinding")):
        if not any(s["kind"] == "ServiceAccount" and s["name"] == account for s in binding["subjects"]):
            continue
        role = roles[(binding["roleRef"]["kind"], binding["roleRef"]["name"])]
        for rule in role["rules"]:
            only = tuple(sorted(rule.get("resourceNames", [])))
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    granted |= {(group, resource, verb, *((only,) if names else ())) for verb in rule["verbs"]}
    return granted


def test_deploy_grants_exactly_the_calls_the_code_lists_to_the_account_pods_run_as():
    """Finding 7 and issue 22: the run's account (every KFP pod: KFP's driver, launcher and
    Argo's executor beside liftoff's component) is granted every call in components/k8s.py,
    liftoff's own and KFP's (the kfp-launcher ConfigMap and the artifact Secret, by name
    only), and nothing the code does not list; the replicas' account is granted nothing."""
    from components.config import compose

    docs = list(yaml.safe_load_all((ROOT / "deploy" / "rbac.yaml").read_text()))
    granted = _granted(docs, k8s.SERVICE_ACCOUNT, names=True)
    needed = {(a.group, a.resource, a.verb, tuple(sorted(a.names))) for a in (*k8s.ACCESS, *k8s.KFP_ACCESS)}
    assert needed - granted == set(), f"not granted: {sorted(needed - granted)}"
    assert granted - needed == set(), f"granted but never used: {sorted(granted - needed)}"
    assert ("", "configmaps", "get", ("kfp-launcher",)) in granted  # KFP's root driver fails on Forbidden
    assert ("", "secrets", "get", ("mlpipeline-minio-artifact",)) in granted  # and no other Secret
    assert _granted(docs, k8s.REPLICA_SERVICE_ACCOUNT) == set()
    accounts = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ServiceAccount"}
    assert accounts[k8s.REPLICA_SERVICE_ACCOUNT]["automountServiceAccountToken"] is False
    cfg = compose(["cluster=kubernetes"])
    assert cfg.kfp.service_account == k8s.SERVICE_ACCOUNT and cfg.cluster.service_account == k8s.REPLICA_SERVICE_ACCOUNT
    quarantine = [d for d in docs if d["kind"] == "ClusterRoleBinding"]
    assert all("kubeflow" in d["metadata"]["name"] for d in quarantine)  # per namespace: `sed s/kubeflow/$NS/g`


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
    listed = {(a.group, a.resource, a.verb) for a in (*k8s.ACCESS, *k8s.KFP_ACCESS)}
    assert calls <= listed, f"made but not listed in components/k8s.py: {sorted(calls - listed)}"


def _executors(rendered) -> dict[str, dict]:
    return rendered["pipeline"][1]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]


def test_every_kfp_task_gets_the_pull_secret_requests_and_retries(rendered):
    """Issue 22, acceptance 1 (the KFP side): every executor pulls with the pull secret, asks
    for CPU and memory (never BestEffort), and every task retries a failed pod."""
    pipeline = rendered["pipeline"][0]
    executors = _executors(rendered)
    containers = pipeline["deploymentSpec"]["executors"]
    assert set(executors) == set(containers) and len(containers) == 7
    for name, executor in executors.items():
        assert [s["secretName"] for s in executor["imagePullSecret"]] == ["regcred"], name
        resources = containers[name]["container"]["resources"]
        assert resources["resourceCpuRequest"] == "1" and resources["resourceMemoryRequest"] in ("4G", "16G")
    assert containers["exec-evaluate"]["container"]["resources"]["resourceMemoryRequest"] == "16G"
    tasks = {**pipeline["root"]["dag"]["tasks"], **pipeline["components"]["comp-for-loop-1"]["dag"]["tasks"]}
    for name, task in tasks.items():
        if name not in ("for-loop-1", "preflight", "tokenize-plan"):
            assert task["retryPolicy"]["maxRetryCount"] == 2, name
    # the tasks that check every group and the inputs: a deterministic failure is not retried
    assert "retryPolicy" not in tasks["preflight"] and "retryPolicy" not in tasks["tokenize-plan"]
    groups = {"data", "tokenizer", "model", "store"} | {"data", "model", "train", "eval", "cluster", "preflight"}
    checked = set(tasks["tokenize-plan"]["inputs"]["parameters"]) | set(tasks["preflight"]["inputs"]["parameters"])
    assert groups == checked == {"data", "tokenizer", "model", "train", "eval", "cluster", "preflight", "store"}


@pytest.mark.parametrize("job", ["train", "preflight"])
def test_rendered_jobs_carry_policies_ttl_the_fabric_and_the_volumes(rendered, job):
    """Issue 22, acceptance 1 (the Volcano side): a failed or deleted replica aborts the job at
    once; Volcano deletes it a day after it ends; every replica pod has the RDMA device, IPC_LOCK,
    the Multus annotation, the NCCL env, the three volumes mounted and an ephemeral-storage
    request covering its writable layer and the disk-backed emptyDir (all schema-checked above)."""
    spec = rendered[job]["spec"]
    assert spec["policies"] == [
        {"event": "PodEvicted", "action": "AbortJob"},
        {"event": "PodFailed", "action": "AbortJob"},
    ]
    assert spec["ttlSecondsAfterFinished"] == 86400
    for task in spec["tasks"]:
        pod = task["template"]
        assert pod["metadata"]["annotations"]["k8s.v1.cni.cncf.io/networks"] == "rdma-net"
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        assert volumes["scratch"]["hostPath"] == {"path": "/mnt/nvme", "type": "DirectoryOrCreate"}
        assert volumes["spill"]["emptyDir"] == {"sizeLimit": "100Gi"}
        assert volumes["shared"]["persistentVolumeClaim"] == {"claimName": "ckpt"}
        assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
        for c in pod["spec"]["containers"]:
            assert c["resources"]["limits"]["rdma/rdma_shared_device_a"] == "1"
            assert c["resources"]["requests"]["rdma/rdma_shared_device_a"] == "1"
            assert c["resources"]["requests"]["ephemeral-storage"] == "150Gi"  # 50 + the 100 Gi emptyDir
            assert c["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
            env = {e["name"]: e.get("value") for e in c["env"]}
            assert env["NCCL_IB_HCA"] == "=mlx5_0" and env["NCCL_SOCKET_IFNAME"] == "eth0"
            mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
            assert mounts == {"dshm": "/dev/shm", "scratch": "/scratch", "spill": "/spill", "shared": "/shared"}


def test_train_replicas_carry_the_scrape_annotations_and_the_port_the_podmonitor_selects(rendered):
    """Issue 25, acceptance 1 (the cluster side): with train.metrics_port every train replica pod
    is annotated for annotation-based scrape configs and names the port deploy/monitoring's
    PodMonitor scrapes, on pods its selector matches (schema-checked above); preflight's are not."""
    monitor = yaml.safe_load((ROOT / "deploy" / "monitoring" / "podmonitor.yaml").read_text())
    endpoint = monitor["spec"]["podMetricsEndpoints"][0]
    selected = [e["key"] for e in monitor["spec"]["selector"]["matchExpressions"] if e["operator"] == "Exists"]
    for task in rendered["train"]["spec"]["tasks"]:
        pod = task["template"]
        annotations = pod["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/port"] == "9400" and annotations["prometheus.io/path"] == endpoint["path"]
        assert all(key in pod["metadata"]["labels"] for key in selected)
        for c in pod["spec"]["containers"]:
            ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
            assert ports[endpoint["port"]] == 9400
    for task in rendered["preflight"]["spec"]["tasks"]:
        assert "prometheus.io/scrape" not in task["template"]["metadata"].get("annotations", {})


def _selects(selector: dict, labels: dict) -> bool:
    """A label selector's matchLabels and matchExpressions against a pod's labels."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        op, present = e["operator"], e["key"] in labels
        if op == "Exists" and not present or op == "DoesNotExist" and present:
            return False
        if op == "In" and labels.get(e["key"]) not in e["values"]:
            return False
        if op == "NotIn" and present and labels[e["key"]] in e["values"]:
            return False
    return True


def test_render_admits_the_monitoring_namespace_to_the_replicas_metrics_port(rendered):
    """Issue 42, acceptance 7: Volcano's svc plugin gives each job a NetworkPolicy admitting only
    its own pods, so Prometheus scraped nothing; render writes a policy (schema-checked) whose
    podSelector selects every rendered train replica pod and admits the monitoring namespace on
    the port the pods name `metrics`. The policy selects no KFP task pod."""
    import kubernetes_validate

    policy = rendered["policy"]
    kubernetes_validate.validate(policy, K8S_VERSION, strict=True)
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"] and policy["metadata"]["namespace"] == "default"
    for task in rendered["train"]["spec"]["tasks"]:
        pod = task["template"]
        assert _selects(spec["podSelector"], pod["metadata"]["labels"])
        (port,) = [p["containerPort"] for c in pod["spec"]["containers"] for p in c["ports"] if p["name"] == "metrics"]
        admitted = [
            rule
            for rule in spec["ingress"]
            if {"protocol": "TCP", "port": port} in rule["ports"]
            and any(
                _selects(
                    peer.get("namespaceSelector", {"matchLabels": {"-": "-"}}),
                    {"kubernetes.io/metadata.name": k8s.MONITORING_NAMESPACE},
                )
                and "podSelector" not in peer
                for peer in rule["from"]
            )
        ]
        assert admitted, spec["ingress"]
    assert not _selects(spec["podSelector"], {"pipelines.kubeflow.org/v2_component": "true"})


@pytest.mark.parametrize("job", ["train", "preflight"])
def test_replicas_get_guaranteed_qos(rendered, job):
    """Issue 42, acceptance 9: requests == limits for cpu and memory in every replica container
    (TorchX requested 100m and 1 GiB less: Burstable, no CPU pinning or NUMA alignment)."""
    for task in rendered[job]["spec"]["tasks"]:
        for c in task["template"]["spec"]["containers"]:
            r = c["resources"]
            assert {k: r["requests"][k] for k in ("cpu", "memory")} == {k: r["limits"][k] for k in ("cpu", "memory")}


@pytest.mark.parametrize("preset", ["h200-7b", "h200-70b"])
def test_the_presets_select_the_gpu_product_of_their_gpu_type(preset):
    """Issue 42, acceptance 9: a preset's replicas land only on nodes whose GPU operator label
    names cluster.gpu_type (the device the plan was judged against)."""
    from components.config import compose

    c = compose([f"experiment={preset}"]).cluster
    assert c.node_selector["nvidia.com/gpu.product"] == f"NVIDIA-{c.gpu_type}"


def test_the_train_job_keeps_checkpoints_and_the_data_cache_on_the_volume(rendered):
    """The replica's spec (what the worker reads) names the mounted volume for its node
    checkpoints and data cache, not the container's writable layer."""
    import base64
    import json
    import re

    command = " ".join(_containers(rendered["train"])[0]["command"])
    spec = json.loads(base64.b64decode(re.search(r"--spec-b64 (\S+)", command).group(1)))
    assert spec["checkpoint_dir"].startswith("/scratch/checkpoints/")
    assert spec["store"]["cache_dir"] == "/scratch/cache"


def test_the_kfp_feature_table_judges_everything_compile_emits_and_the_pinned_backend_runs_it(rendered):
    """Issue 22, acceptance 3: every IR key the compiled pipeline uses is one every v2 backend
    reads or one the table dates; the pipeline needs 2.14.0 for its dsl.Collected merge; and
    every KFP release deploy/README.md installs is at least that."""
    import re

    from pipelines import kfp_features

    spec, platform = rendered["pipeline"]
    for _, name, task in kfp_features._tasks(spec):
        unknown = set(task) - kfp_features.BASELINE_KEYS["task"] - kfp_features.BASELINE_KEYS["loop"]
        assert not unknown, f"task {name} uses IR keys no feature dates: {unknown}"
    for executor in kfp_features._executors(platform):
        assert set(executor) <= kfp_features.BASELINE_KEYS["executor"], set(executor)
    for container in kfp_features._containers(spec):
        assert set(container.get("resources", {})) <= kfp_features.BASELINE_KEYS["resources"]
    floor, why = kfp_features.required_backend(spec, platform)
    assert floor == (2, 14, 0) and any("dsl.Collected" in f.name for f in why)
    used = {f.name for f in kfp_features.emitted(spec, platform)}
    assert {"image pull secrets", "emptyDir volumes (the /dev/shm mount)"} <= used
    assert not any("pipeline parameter" in u for u in used)  # literal secret names and requests
    readme = (ROOT / "deploy" / "README.md").read_text()
    pinned = re.findall(r"PIPELINE_VERSION=(\S+)", readme)
    assert pinned, "deploy/README.md pins no KFP release"
    for version in pinned:
        assert kfp_features.parse_version(version) >= floor, f"deploy/README.md installs KFP {version}"


@pytest.mark.parametrize("through_ui", [False, True], ids=["api-server", "through-ui"])
@pytest.mark.parametrize("reported, ok", [("2.5.0", False), ("2.14.0", True), ("2.16.1", True), ("unknown", True)])
def test_submit_refuses_a_backend_older_than_the_pipeline_needs_in_one_line(
    tmp_path, monkeypatch, capsys, reported, ok, through_ui
):
    """Issue 22, acceptance 3: `submit` reads the backend's version off its healthz (the API
    server's, or the UI's when the endpoint is ml-pipeline-ui, as deploy/README.md's is); against a
    2.5.0 backend it fails in one line naming 2.14 and the feature, before any run is created;
    a backend that does not report its version gets a warning and the run. (No cluster here: the
    doctor's checks, which come first, are skipped; tests/pipeline/test_doctor.py has them.)"""
    from tests.pipeline.fake_kfp import FakeKfp

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MINIO_ACCESS_KEY", S3_ACCESS_KEY)
    monkeypatch.setenv("MINIO_SECRET_KEY", S3_SECRET_KEY)
    with FakeKfp() as kfp:
        kfp.version, kfp.through_ui = reported, through_ui
        rc = main(["submit", "--skip-doctor", f"kfp.host={kfp.url}", *CLUSTER])
    err = capsys.readouterr().err.strip().splitlines()
    assert any(r["path"].endswith("/healthz") for r in kfp.requests)
    if ok:
        assert rc == 0 and len(kfp.runs) == 1
        assert err == ([] if reported != "unknown" else [err[0]])
        assert reported != "unknown" or "does not report its version" in err[0]
    else:
        assert rc == 2 and kfp.runs == [] and len(err) == 1
        assert f"is {reported}; this pipeline needs >= 2.14.0 for dsl.Collected" in err[0], err


def test_a_cluster_preset_publishes_no_tiny_value(tmp_path, monkeypatch):
    """Issue 22, acceptance 6: every key the tiny CPU preset sets is set again by the cluster
    presets, and the compiled pipeline's defaults (what a UI run starts from) carry the
    cluster's values: one process per GPU, every node healthy, the real sequence length."""
    from omegaconf import OmegaConf

    from components.config import CONF_DIR

    def keys(node, prefix=""):
        return {
            k
            for key, v in node.items()
            for k in (keys(v, f"{prefix}{key}.") if isinstance(v, dict) else [prefix + key])
        }

    tiny = keys(yaml.safe_load((CONF_DIR / "experiment" / "tiny.yaml").read_text()))
    monkeypatch.chdir(tmp_path)
    for preset in ("h200-7b", "h200-70b"):
        mine = yaml.safe_load((CONF_DIR / "experiment" / f"{preset}.yaml").read_text())
        assert tiny - keys(mine) == set(), f"{preset} leaves tiny's {sorted(tiny - keys(mine))}"
        assert main(["compile", f"experiment={preset}"]) == 0
        params = yaml.safe_load_all((tmp_path / "build" / "pretrain.yaml").read_text()).__next__()
        d = {g: p["defaultValue"] for g, p in params["root"]["inputDefinitions"]["parameters"].items()}
        assert d["cluster"]["procs_per_node"] == d["cluster"]["gpu"] == 8 and d["cluster"]["scheduler"] == "kubernetes"
        assert (
            "min_healthy_nodes" not in d["preflight"] and d["preflight"]["zscore_threshold"] == 5.0  # null: every node
        )
        assert d["data"]["seq_len"] == 4096 and d["store"]["backend"] == "minio" and d["model"]["name"] == preset[5:]
        expected = OmegaConf.to_container(OmegaConf.create(mine), resolve=False)
        for key in tiny:
            group, *path = key.split(".")
            value, want = d[group], expected[group]
            for part in path:
                value, want = value.get(part), want[part]  # a null leaves the compiled default out
            if not (isinstance(want, str) and want.startswith("${")):
                assert value == want, (preset, key, value, want)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["cluster=kubernetes", "cluster.procs_per_node=8"], "store.backend=local with cluster.scheduler=kubernetes"),
        (["cluster=kubernetes", "store=minio"], "cluster.procs_per_node=1 with cluster.gpu=8"),
        (
            ["experiment=h200-70b", "train.grad_accum_steps=16", "train.fsdp_sync_every_microbatch=false"],
            r"the plan does not fit by \d+\.\d GiB: \d+\.\d GiB per device \(preflight\.memory_headroom=0\.1\) "
            r"> 131\.3 GiB \(H200",
        ),
    ],
    ids=["local-store", "one-process-for-8-gpus", "plan-does-not-fit"],
)
def test_render_refuses_a_cluster_run_that_cannot_work_in_one_line(tmp_path, monkeypatch, capsys, overrides, message):
    """Issue 22, acceptance 6: nothing is written, and the error is one line naming the key."""
    import re

    monkeypatch.chdir(tmp_path)
    assert main(["render", *overrides]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(message, err[0]), err
    assert not (tmp_path / "build").exists()


def test_render_with_the_default_local_config_refuses_in_one_line_naming_a_preset_that_renders(
    tmp_path, monkeypatch, capsys
):
    """Issue 43, point 2: `liftoff render` with no overrides (cluster.scheduler=local_cwd) was a
    26-line TorchX traceback; it is one line naming a cluster preset, and that preset renders."""
    monkeypatch.chdir(tmp_path)
    assert main(["render"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == (
        "liftoff render: render shows the Kubernetes objects of a cluster run, and cluster.scheduler=local_cwd "
        "(this machine) creates none: render a cluster preset on data that fills its steps (liftoff render "
        "experiment=h200-7b data=hub data.hub_revision=<commit>), or use `liftoff compile` for the pipeline alone\n"
    )
    assert not (tmp_path / "build").exists()
    assert main(["render", "experiment=h200-7b", "data=hub", f"data.hub_revision={'0' * 40}"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "wrote build/pretrain.yaml",
        "wrote build/jobs/train.yaml",
        "wrote build/jobs/preflight.yaml",
    ]
    train = yaml.safe_load((tmp_path / "build" / "jobs" / "train.yaml").read_text())
    assert train["kind"] == "Job" and train["apiVersion"].startswith("batch.volcano.sh/")


@pytest.mark.parametrize("command", ["render", "submit"])
def test_the_guides_first_submit_on_the_shipped_corpus_is_refused_before_any_kfp_call(
    tmp_path, monkeypatch, capsys, command
):
    """Issue 42, acceptance 2: experiment=h200-7b on the default data (the shipped 702 KB corpus,
    at most 171 blocks of 4097 tokens) cannot fill one step of 2 x 8 x 4 x 4 = 256 blocks; render
    and submit refuse it in one line with both numbers, before any call to KFP (and with nothing
    written), estimated from the source bytes since the corpus is not tokenized yet."""
    from tests.pipeline.fake_kfp import FakeKfp

    monkeypatch.chdir(tmp_path)  # data.paths' corpus/kjv.jsonl: the checkout's, as the image carries it
    monkeypatch.setenv("MINIO_ACCESS_KEY", S3_ACCESS_KEY)
    monkeypatch.setenv("MINIO_SECRET_KEY", S3_SECRET_KEY)
    with FakeKfp() as kfp:
        assert main([command, "experiment=h200-7b", f"kfp.host={kfp.url}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    size = (ROOT / "corpus" / "kjv.jsonl").stat().st_size
    assert len(err) == 1 and "the data cannot fill one step" in err[0], err
    assert f"= 256 blocks of 4097 tokens per step, but data.paths ({size} bytes) gives at most {size // 4097}" in err[0]
    assert kfp.requests == [] and not (tmp_path / "build").exists()


def test_host_network_replicas_keep_resolving_cluster_services():
    """cluster.host_network=true (RDMA NICs without Multus): every replica pod is on the node's
    network and keeps cluster DNS (ClusterFirstWithHostNet), so the store's service name still
    resolves; the pod passes the Kubernetes schema."""
    import kubernetes_validate
    from omegaconf import OmegaConf

    from components.config import compose
    from components.launcher import kubernetes_job
    from components.train.stage import train_launch

    cfg = OmegaConf.to_object(compose([*CLUSTER, "cluster.namespace=team-a", "cluster.host_network=true"]))
    _, _, launch = train_launch("dataset/d@v", cfg.model, cfg.train, cfg.cluster, cfg.store, cache_gb=cfg.data.cache_gb)
    job = k8s.as_plain(kubernetes_job(launch, {"LIFTOFF_ATTEMPT": "0"}, namespace="team-a").request.resource)
    assert not list(_volcano_validator().iter_errors(job))
    for task in job["spec"]["tasks"]:
        spec = task["template"]["spec"]
        assert spec["hostNetwork"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
        pod = {"apiVersion": "v1", "kind": "Pod", **task["template"]}
        pod["metadata"] = {"name": task["name"], **pod.get("metadata", {})}
        kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
