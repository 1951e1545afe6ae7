"""What liftoff asks of Kubernetes: the finishing touches on the Volcano jobs TorchX
generates, the lifecycle calls around them, and the list of every API call a run's KFP pods
make (liftoff's own, `ACCESS`, and KFP's driver and launcher's, `KFP_ACCESS`), which
`deploy/rbac.yaml` grants to the account they run as; the replicas' account holds none."""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SERVICE_ACCOUNT = "liftoff"  # the KFP tasks (drivers): every call in ACCESS and KFP_ACCESS
REPLICA_SERVICE_ACCOUNT = "liftoff-replica"  # the TorchX replicas: no API rights at all
JOB_LABEL = "liftoff.dev/job"  # the stage's job name (train-<identity[:8]>): every run of one config shares it
LAUNCH_LABEL = "liftoff.dev/launch"  # the driver's own launch id: which run a vcjob belongs to
ATTEMPT_LABEL = "liftoff.dev/attempt"  # that launch's attempt (0, then each relaunch after a failure)
METRICS_PORT_NAME = "metrics"  # train.metrics_port on a replica's container; deploy/monitoring's PodMonitor scrapes it
# the driver pod (KFP v2 sets both in every executor container, by the downward API; POD_* elsewhere)
DRIVER_POD_ENV = (("KFP_POD_NAME", "KFP_POD_UID"), ("POD_NAME", "POD_UID"))
# env name in the replica -> key in the Secret `store.secret_name` (deploy/minio-secret.yaml)
STORE_SECRET_KEYS = {"MINIO_ACCESS_KEY": "accesskey", "MINIO_SECRET_KEY": "secretkey", "MINIO_ENDPOINT": "endpoint"}
NODE_NAME_FROM_POD = "[FIELD_PATH]spec.nodeName"  # TorchX turns this into a fieldRef env value
# Volcano's reaction to a pod's end (events and actions: volcano-sh/apis v1.15
# pkg/apis/bus/v1alpha1/{events,actions}.go). With no policy a failed pod changes nothing: the
# job stays Running until every pod has ended (volcano-sh/volcano pkg/controllers/job/state/
# running.go, the default branch), so the survivors would sit in a collective until the
# watchdog fires. Here a replica failed or deleted (PodEvicted is sent on a pod's deletion,
# job_controller_handler.go) aborts the whole job at once; the driver sees it end (TorchX maps
# Aborted to CANCELLED) and relaunches it (cluster.max_restarts), resuming from the store: one
# restart mechanism, never Volcano's RestartJob beside the driver's. TorchX's `maxRetry: 0` is
# rewritten to 3 by Volcano's webhook (pkg/webhooks/admission/jobs/mutate/mutate_job.go), which
# matters only to RestartJob: AbortJob never retries. No TaskCompleted -> CompleteJob: rank 0's
# task may end while the others still upload their checkpoint shards.
JOB_POLICIES = ({"event": "PodEvicted", "action": "AbortJob"}, {"event": "PodFailed", "action": "AbortJob"})
# The namespace Prometheus scrapes from (kube-prometheus-stack's usual one). Volcano's svc plugin
# gives every job a NetworkPolicy admitting only that job's own pods (volcano-sh/volcano
# pkg/controllers/job/plugins/svc/svc.go); policies add up, so the one `metrics_policy` writes
# admits this namespace to the replicas' metrics port beside it.
MONITORING_NAMESPACE = "monitoring"
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
IN_CLUSTER_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


@dataclass(frozen=True)
class Access:
    group: str  # "" is the core API group
    resource: str  # "jobs", "jobs/status", "pods/log", ...
    verb: str
    why: str
    cluster_scoped: bool = False
    names: tuple[str, ...] = ()  # resourceNames: only these objects (empty: any)


ACCESS = (
    Access("batch.volcano.sh", "jobs", "create", "TorchX submits the train and preflight jobs"),
    Access("batch.volcano.sh", "jobs", "get", "TorchX describe_native; cancel reads the job first"),
    Access("batch.volcano.sh", "jobs", "list", "a relaunch finds its own earlier attempt's job by label"),
    Access("batch.volcano.sh", "jobs", "watch", "waiting on a job without polling"),
    Access("batch.volcano.sh", "jobs", "delete", "the driver deletes its own earlier attempt's job, or an orphan's"),
    Access("batch.volcano.sh", "jobs/status", "get", "TorchX describe and wait read the job's phase"),
    Access("batch.volcano.sh", "jobs/status", "update", "TorchX cancel marks the job Aborted"),
    Access("", "pods", "get", "TorchX describe reads replica IPs; log streaming; is a job's driver alive"),
    Access("", "pods", "list", "log streaming finds a replica's pod"),
    Access("", "pods", "watch", "log streaming waits for the pod to start"),
    Access("", "pods/log", "get", "the driver streams every replica's log"),
    Access("scheduling.volcano.sh", "podgroups", "list", "a job left pending: its PodGroup's conditions say why"),
    Access("", "events", "list", "a job left pending: the scheduler's warnings on its pods"),
    Access("", "nodes", "get", "preflight quarantine reads the node", cluster_scoped=True),
    Access("", "nodes", "patch", "preflight quarantine labels and taints it", cluster_scoped=True),
)


# The calls KFP's own code makes with the run's service account (`kfp.service_account`): every
# workflow pod of a run, KFP's driver and launcher beside liftoff's component, runs as it. From
# kubeflow/pipelines at 2.14.0-2.17.0 and argo-workflows 3.5-3.7 (the versions KFP ships).
# PVC tasks (CreatePVC) and run-time placeholders (workflows get) are not used by this pipeline.
KFP_ACCESS = (
    Access("", "configmaps", "get", "KFP's root driver reads its launcher config; NotFound is defaults, Forbidden "
           "fails the run (backend/src/v2/config/env.go, driver/root_dag.go)", names=("kfp-launcher",)),
    Access("", "secrets", "get", "KFP's launcher opens the artifact bucket with these keys "
           "(backend/src/v2/objectstore/object_store.go@2.14.0)", names=("mlpipeline-minio-artifact",)),
    Access("", "pods", "get", "KFP's launcher reads its own pod for the retry index (launcher_v2.go@2.17.0)"),
    Access("", "pods", "patch", "Argo's executor falls back to annotating its pod (executor.go@v3.5.14)"),
    Access("argoproj.io", "workflowtaskresults", "create", "Argo's executor reports each task's outputs "
           "(argo-workflows docs/workflow-rbac.md@v3.5.14)"),
    Access("argoproj.io", "workflowtaskresults", "patch", "Argo's executor reports each task's outputs"),
)  # fmt: skip


def namespace(configured: str | None) -> str:
    """`cluster.namespace`, or (null) the namespace this pod runs in: on multi-user Kubeflow
    the run's own profile namespace."""
    if configured:
        return configured
    if IN_CLUSTER_NAMESPACE.is_file():
        return IN_CLUSTER_NAMESPACE.read_text().strip()
    raise ValueError("cluster.namespace is null and this is not a pod: set cluster.namespace")


def label_value(text: str) -> str:
    """`text` as a valid label value: [A-Za-z0-9._-], at most 63, alphanumeric at both ends."""
    return re.sub(r"[^A-Za-z0-9._-]", "-", text)[:63].strip("-._")


def attempt_name(job_name: str, launch_id: str, attempt: int) -> str:
    """The name one attempt of one launch gives TorchX (which appends its own unique suffix):
    `train-1a2b3c4d-<launch id's last 8>-a<attempt>`, so two runs of one config, and a run's
    relaunches, never share a vcjob name, and `kubectl get vcjob` tells them apart."""
    short = re.sub(r"[^a-z0-9]", "", launch_id.lower())[-8:]
    return f"{job_name}-{short}-a{attempt}"


def driver_owner(ns: str) -> dict[str, str] | None:
    """An ownerReference to the driver pod, when this process is one (its name and UID from
    the downward API) in the namespace the job goes to: the job is then garbage-collected
    with the pod. None elsewhere (`liftoff render`, a driver outside the cluster, a job in
    another namespace: an ownerReference cannot cross namespaces, and one whose owner the
    garbage collector cannot find in the job's own namespace deletes the job at once)."""
    found = [(os.environ[n], os.environ[u]) for n, u in DRIVER_POD_ENV if os.environ.get(n) and os.environ.get(u)]
    if not found:
        return None
    name, uid = found[0]
    own = os.environ.get("POD_NAMESPACE") or (
        IN_CLUSTER_NAMESPACE.read_text().strip() if IN_CLUSTER_NAMESPACE.is_file() else None
    )
    if own != ns:
        log.info("vcjob not owned by driver pod %s: it runs in namespace %s, the job in %s", name, own, ns)
        return None
    # no blockOwnerDeletion: setting it needs `update` on pods/finalizers, and nothing waits on it
    return {"apiVersion": "v1", "kind": "Pod", "name": name, "uid": uid}


def finish_job(
    resource: dict[str, Any],
    cluster,
    secret_name: str | None,
    job_name: str,
    exclude_nodes=(),
    *,
    launch_id: str | None = None,
    attempt: int = 0,
    owner: dict[str, str] | None = None,
    metrics_port: int = 0,
) -> dict[str, Any]:
    """What TorchX's generated Volcano job lacks, on every replica's pod: store credentials by
    `secretKeyRef` (never literal values: whoever can read vcjobs could read them), the GPU
    node selector and toleration, a node anti-affinity for the nodes preflight excluded, the
    pull policy and pull secrets, and the labels (the stage's job name, the launch and its
    attempt); on the job, the ownerReference to its driver pod when there is one."""
    from kubernetes.client import (
        V1EnvVar,
        V1EnvVarSource,
        V1LocalObjectReference,
        V1SecretKeySelector,
        V1Toleration,
    )

    labels = {JOB_LABEL: job_name}
    if launch_id:
        labels.update({LAUNCH_LABEL: label_value(launch_id), ATTEMPT_LABEL: str(attempt)})
    resource["metadata"].setdefault("labels", {}).update(labels)
    if owner:
        resource["metadata"]["ownerReferences"] = [owner]
    resource["spec"]["policies"] = [dict(p) for p in JOB_POLICIES]
    if cluster.job_ttl_s:
        resource["spec"]["ttlSecondsAfterFinished"] = cluster.job_ttl_s
    for task in resource["spec"]["tasks"]:
        pod_name = f"{resource['metadata']['name']}-{task['name']}-0"
        if len(pod_name) > 63:
            raise ValueError(f"pod name {pod_name!r} exceeds Kubernetes' 63 characters: shorten the job name")
        pod = task["template"]
        pod.metadata.labels.update(labels)
        spec = pod.spec
        spec.node_selector = {**(spec.node_selector or {}), **dict(cluster.node_selector)}
        if cluster.gpu > 0:
            spec.tolerations = [*(spec.tolerations or []), V1Toleration(**GPU_TOLERATION)]
        if exclude_nodes:
            spec.affinity = _away_from(sorted(exclude_nodes))
        if cluster.image_pull_secrets:
            spec.image_pull_secrets = [V1LocalObjectReference(name=n) for n in cluster.image_pull_secrets]
        spec.automount_service_account_token = False  # the replicas call no Kubernetes API
        _fabric(pod, cluster)
        if metrics_port:
            _scraped(pod, metrics_port)
        for container in spec.containers:
            container.image_pull_policy = cluster.image_pull_policy
            env = [e for e in container.env or [] if e.name not in STORE_SECRET_KEYS]
            if secret_name:
                env += [
                    V1EnvVar(
                        name=k, value_from=V1EnvVarSource(secret_key_ref=V1SecretKeySelector(name=secret_name, key=v))
                    )
                    for k, v in STORE_SECRET_KEYS.items()
                ]
            container.env = env
    return resource


def metrics_policy(namespace: str, port: int, monitoring: str = MONITORING_NAMESPACE) -> dict[str, Any]:
    """A NetworkPolicy admitting the monitoring namespace's pods to the metrics port of every
    liftoff replica pod (labelled JOB_LABEL by finish_job) in `namespace`: without it the
    policy Volcano's svc plugin adds lets only the job's own pods in, and nothing is scraped."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": "liftoff-metrics", "namespace": namespace},
        "spec": {
            "podSelector": {"matchExpressions": [{"key": JOB_LABEL, "operator": "Exists"}]},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": monitoring}}}],
                    "ports": [{"protocol": "TCP", "port": port}],
                }
            ],
        },
    }


def _scraped(pod, port: int) -> None:
    """A replica serving Prometheus metrics: the annotations annotation-based scrape configs
    read, and a named container port the PodMonitor in deploy/monitoring/ selects."""
    from kubernetes.client import V1ContainerPort

    scrape = {"prometheus.io/scrape": "true", "prometheus.io/port": str(port), "prometheus.io/path": "/metrics"}
    pod.metadata.annotations = {**(pod.metadata.annotations or {}), **scrape}
    for container in pod.spec.containers:
        ports = [p for p in container.ports or [] if p.name != METRICS_PORT_NAME]
        container.ports = [*ports, V1ContainerPort(name=METRICS_PORT_NAME, container_port=port, protocol="TCP")]


def _fabric(pod, cluster) -> None:
    """The network and the disks a replica needs beyond what TorchX sets: extra device
    resources (RDMA NICs), capabilities, pod annotations (Multus), the host network, volumes
    for the data cache and node checkpoints, an ephemeral-storage request. (`cluster.env`, the
    NCCL/GLOO variables, is declared with the role's environment, on every scheduler.)"""
    from kubernetes.client import (
        V1Capabilities,
        V1EmptyDirVolumeSource,
        V1HostPathVolumeSource,
        V1PersistentVolumeClaimVolumeSource,
        V1SecurityContext,
        V1Volume,
        V1VolumeMount,
    )

    spec = pod.spec
    if cluster.pod_annotations:
        pod.metadata.annotations = {**(pod.metadata.annotations or {}), **dict(cluster.pod_annotations)}
    if cluster.host_network:
        spec.host_network = True
        spec.dns_policy = "ClusterFirstWithHostNet"  # service names (the store) still resolve
    for v in cluster.volumes:
        if v.kind == "emptyDir":
            source = {"empty_dir": V1EmptyDirVolumeSource(medium=v.medium or None, size_limit=_gi(v.size_gb))}
        elif v.kind == "hostPath":
            source = {"host_path": V1HostPathVolumeSource(path=v.host_path, type="DirectoryOrCreate")}
        else:
            source = {"persistent_volume_claim": V1PersistentVolumeClaimVolumeSource(claim_name=v.claim_name)}
        spec.volumes = [*(spec.volumes or []), V1Volume(name=v.name, **source)]
    scratch = sum(v.size_gb or 0 for v in cluster.volumes if v.kind == "emptyDir" and not v.medium)
    for container in spec.containers:
        resources = container.resources
        for name in ("cpu", "memory"):  # requests == limits: Guaranteed QoS (CPU pinning, NUMA alignment)
            if name in (resources.limits or {}):
                resources.requests[name] = resources.limits[name]
        for name, count in cluster.extra_resources.items():
            resources.limits[name] = resources.requests[name] = str(count)
        if storage := cluster.ephemeral_storage_gb + scratch:  # an emptyDir on disk counts as ephemeral
            resources.requests["ephemeral-storage"] = _gi(storage)
        if cluster.capabilities:
            context = container.security_context or V1SecurityContext()
            context.capabilities = V1Capabilities(add=sorted(cluster.capabilities))
            container.security_context = context
        container.volume_mounts = [
            *(container.volume_mounts or []),
            *(V1VolumeMount(name=v.name, mount_path=v.mount_path) for v in cluster.volumes),
        ]


def _gi(gb: int | None) -> str | None:
    return f"{gb}Gi" if gb else None


def _away_from(nodes: list[str]):
    """Required node affinity: not on these nodes (by `metadata.name`, the NODE_NAME preflight recorded)."""
    from kubernetes.client import (
        V1Affinity,
        V1NodeAffinity,
        V1NodeSelector,
        V1NodeSelectorRequirement,
        V1NodeSelectorTerm,
    )

    away = V1NodeSelectorRequirement(key="metadata.name", operator="NotIn", values=nodes)
    terms = V1NodeSelector(node_selector_terms=[V1NodeSelectorTerm(match_fields=[away])])
    return V1Affinity(node_affinity=V1NodeAffinity(required_during_scheduling_ignored_during_execution=terms))


def as_plain(resource: dict[str, Any]) -> dict[str, Any]:
    """The resource as the API server would receive it (camelCase keys, no None values)."""
    from kubernetes.client import ApiClient

    return ApiClient().sanitize_for_serialization(resource)


def load_config() -> None:
    """The API server and credentials: this pod's service account, else $KUBECONFIG (or ~/.kube/config)."""
    from kubernetes import config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()


def _apis():
    from kubernetes import client

    load_config()
    return client.CustomObjectsApi(), client.CoreV1Api()


def delete_earlier_attempts(ns: str, job_name: str, launch_id: str, attempt: int, api=None, core=None) -> list[str]:
    """Before an attempt is submitted, delete the vcjobs that must not hold GPUs next to it:
    this launch's own earlier attempts (same launch label, a lower attempt: a relaunch after
    a failure whose cancel did not go through) and orphans, jobs of this stage's name whose
    owner driver pod is gone or has ended (a driver OOM-killed or lost with its node, then
    retried from the KFP UI). Another run's job, with a live driver or none known, is never
    touched: two runs of one config share the job name and must not delete each other's."""
    if api is None or core is None:
        api, core = _apis()
    found = api.list_namespaced_custom_object(
        "batch.volcano.sh", "v1alpha1", ns, "jobs", label_selector=f"{JOB_LABEL}={job_name}"
    )
    mine = label_value(launch_id)
    deleted = []
    for item in found.get("items", []):
        meta = item["metadata"]
        labels = meta.get("labels") or {}
        name, theirs = meta["name"], labels.get(LAUNCH_LABEL)
        if theirs == mine:
            earlier = labels.get(ATTEMPT_LABEL, "").isdigit() and int(labels[ATTEMPT_LABEL]) < attempt
            why = f"attempt {labels.get(ATTEMPT_LABEL)} of this launch ({launch_id})" if earlier else None
        else:
            why = _orphaned(core, ns, meta)
        if why is None:
            log.info("leaving vcjob %s/%s alone: it belongs to launch %s", ns, name, theirs or "(unlabelled)")
            continue
        log.warning("deleting vcjob %s/%s left by %s", ns, name, why)
        api.delete_namespaced_custom_object("batch.volcano.sh", "v1alpha1", ns, "jobs", name)
        deleted.append(name)
    return deleted


def _orphaned(core, ns: str, meta: dict) -> str | None:
    """Why a job's driver is known to be gone (its owner pod deleted, replaced or ended), or
    None while it may be alive or no owner is recorded."""
    from kubernetes.client.exceptions import ApiException

    for ref in meta.get("ownerReferences") or []:
        if ref.get("kind") != "Pod":
            continue
        try:
            pod = core.read_namespaced_pod(ref["name"], ns)
        except ApiException as e:
            if e.status == 404:
                return f"driver pod {ref['name']}, which no longer exists"
            raise
        if pod.metadata.uid != ref.get("uid"):
            return f"driver pod {ref['name']} (uid {ref.get('uid')}), which no longer exists"
        if pod.status is not None and pod.status.phase in ("Succeeded", "Failed"):
            return f"driver pod {ref['name']}, which has ended ({pod.status.phase})"
    return None


def why_unscheduled(ns: str, job: str, api=None, core=None) -> str:
    """Why Volcano holds a job's gang: its PodGroup's conditions (`Unschedulable`, with the
    scheduler's message: "2/2 tasks in gang unschedulable: ... 2 Insufficient nvidia.com/gpu")
    and the newest warning events on the PodGroup and the job's pods."""
    if api is None or core is None:
        api, core = _apis()
    groups = api.list_namespaced_custom_object("scheduling.volcano.sh", "v1beta1", ns, "podgroups")
    mine = [
        g
        for g in groups.get("items", [])
        if any(r.get("name") == job for r in g["metadata"].get("ownerReferences") or [])
    ]
    reasons = []
    for group in mine:
        status = group.get("status") or {}
        for c in status.get("conditions") or []:
            if c.get("type") == "Unschedulable" and c.get("status", "True") == "True":
                reasons.append(f"PodGroup {group['metadata']['name']}: {c.get('reason', '')}: {c.get('message', '')}")
        if not reasons and status.get("phase"):
            reasons.append(f"PodGroup {group['metadata']['name']} is {status['phase']}")
    events = core.list_namespaced_event(ns, field_selector="type=Warning").items
    about = [e for e in events if (e.involved_object.name or "").startswith(job)]
    about.sort(key=lambda e: str(e.last_timestamp or e.event_time or ""))
    reasons += [f"{e.involved_object.kind} {e.involved_object.name}: {e.reason}: {e.message}" for e in about[-3:]]
    return "; ".join(reasons) or f"no PodGroup or event names a reason (kubectl describe podgroup -n {ns})"
