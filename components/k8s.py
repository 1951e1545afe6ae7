"""What liftoff asks of Kubernetes: the finishing touches on the Volcano jobs TorchX
generates, the lifecycle calls around them, and the list of every API call liftoff's pods
make, which `deploy/rbac.yaml` grants to the one service account they run as."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SERVICE_ACCOUNT = "liftoff"
JOB_LABEL = "liftoff.dev/job"  # the vcjob's name before TorchX's unique suffix: a relaunch finds its predecessor
# env name in the replica -> key in the Secret `store.secret_name` (deploy/minio-secret.yaml)
STORE_SECRET_KEYS = {"MINIO_ACCESS_KEY": "accesskey", "MINIO_SECRET_KEY": "secretkey", "MINIO_ENDPOINT": "endpoint"}
NODE_NAME_FROM_POD = "[FIELD_PATH]spec.nodeName"  # TorchX turns this into a fieldRef env value
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
IN_CLUSTER_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


@dataclass(frozen=True)
class Access:
    group: str  # "" is the core API group
    resource: str  # "jobs", "jobs/status", "pods/log", ...
    verb: str
    why: str
    cluster_scoped: bool = False


ACCESS = (
    Access("batch.volcano.sh", "jobs", "create", "TorchX submits the train and preflight jobs"),
    Access("batch.volcano.sh", "jobs", "get", "TorchX describe_native; cancel reads the job first"),
    Access("batch.volcano.sh", "jobs", "list", "a relaunch finds the earlier attempt's job by label"),
    Access("batch.volcano.sh", "jobs", "watch", "waiting on a job without polling"),
    Access("batch.volcano.sh", "jobs", "delete", "the driver deletes an earlier attempt's job"),
    Access("batch.volcano.sh", "jobs/status", "get", "TorchX describe and wait read the job's phase"),
    Access("batch.volcano.sh", "jobs/status", "update", "TorchX cancel marks the job Aborted"),
    Access("", "pods", "get", "TorchX describe reads replica IPs; log streaming reads the pod"),
    Access("", "pods", "list", "log streaming finds a replica's pod"),
    Access("", "pods", "watch", "log streaming waits for the pod to start"),
    Access("", "pods", "patch", "the KFP launcher annotates its own pod"),
    Access("", "pods/log", "get", "the driver streams every replica's log"),
    Access("argoproj.io", "workflowtaskresults", "create", "the Argo executor of every KFP task"),
    Access("argoproj.io", "workflowtaskresults", "patch", "the Argo executor of every KFP task"),
    Access("", "nodes", "get", "preflight quarantine reads the node", cluster_scoped=True),
    Access("", "nodes", "patch", "preflight quarantine labels and taints it", cluster_scoped=True),
)


def namespace(configured: str | None) -> str:
    """`cluster.namespace`, or (null) the namespace this pod runs in: on multi-user Kubeflow
    the run's own profile namespace."""
    if configured:
        return configured
    if IN_CLUSTER_NAMESPACE.is_file():
        return IN_CLUSTER_NAMESPACE.read_text().strip()
    raise ValueError("cluster.namespace is null and this is not a pod: set cluster.namespace")


def finish_job(
    resource: dict[str, Any], cluster, secret_name: str | None, job_name: str, exclude_nodes=()
) -> dict[str, Any]:
    """What TorchX's generated Volcano job lacks, on every replica's pod: store credentials by
    `secretKeyRef` (never literal values: whoever can read vcjobs could read them), the GPU
    node selector and toleration, a node anti-affinity for the nodes preflight excluded, the
    pull policy and pull secrets, and the job label."""
    from kubernetes.client import (
        V1EnvVar,
        V1EnvVarSource,
        V1LocalObjectReference,
        V1SecretKeySelector,
        V1Toleration,
    )

    resource["metadata"].setdefault("labels", {})[JOB_LABEL] = job_name
    for task in resource["spec"]["tasks"]:
        pod_name = f"{resource['metadata']['name']}-{task['name']}-0"
        if len(pod_name) > 63:
            raise ValueError(f"pod name {pod_name!r} exceeds Kubernetes' 63 characters: shorten the job name")
        pod = task["template"]
        pod.metadata.labels[JOB_LABEL] = job_name
        spec = pod.spec
        spec.node_selector = {**(spec.node_selector or {}), **dict(cluster.node_selector)}
        if cluster.gpu > 0:
            spec.tolerations = [*(spec.tolerations or []), V1Toleration(**GPU_TOLERATION)]
        if exclude_nodes:
            spec.affinity = _away_from(sorted(exclude_nodes))
        if cluster.image_pull_secrets:
            spec.image_pull_secrets = [V1LocalObjectReference(name=n) for n in cluster.image_pull_secrets]
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


def delete_earlier_attempts(ns: str, job_name: str, api=None) -> list[str]:
    """Delete the vcjobs an earlier attempt of this job left (a UI Retry, a driver pod that
    was evicted before it could cancel): two jobs must never hold the same GPUs."""
    if api is None:
        from kubernetes import client, config

        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        api = client.CustomObjectsApi()
    found = api.list_namespaced_custom_object(
        "batch.volcano.sh", "v1alpha1", ns, "jobs", label_selector=f"{JOB_LABEL}={job_name}"
    )
    names = [item["metadata"]["name"] for item in found.get("items", [])]
    for name in names:
        log.warning("deleting vcjob %s/%s left by an earlier attempt of %s", ns, name, job_name)
        api.delete_namespaced_custom_object("batch.volcano.sh", "v1alpha1", ns, "jobs", name)
    return names
