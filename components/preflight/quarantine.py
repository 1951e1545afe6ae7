"""Keep training off unhealthy nodes: label and taint them through the Kubernetes API.

Needs the RBAC in deploy/rbac.yaml (get/patch on nodes). Node names come from
the preflight replicas' NODE_NAME (the downward API's spec.nodeName), else their hostname.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)
LABEL = "liftoff.dev/preflight"
TAINT_KEY = "liftoff.dev/unhealthy"


def quarantine_nodes(node_names: list[str], reasons: dict[str, list[str]], api=None) -> None:
    """Label `liftoff.dev/preflight=unhealthy` and taint NoSchedule each node."""
    if not node_names:
        return
    if api is None:
        from kubernetes import client, config

        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        api = client.CoreV1Api()
    for name in node_names:
        node = api.read_node(name)
        taints = [t for t in (node.spec.taints or []) if t.key != TAINT_KEY]
        taints.append({"key": TAINT_KEY, "value": "true", "effect": "NoSchedule"})
        body = {"metadata": {"labels": {LABEL: "unhealthy"}}, "spec": {"taints": taints}}
        api.patch_node(name, body)
        log.warning("quarantined node %s: %s", name, "; ".join(reasons.get(name, [])))
