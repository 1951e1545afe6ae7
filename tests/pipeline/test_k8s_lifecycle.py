"""A kubernetes-scheduler launch against the loopback API server (tests/pipeline/fake_k8s.py):
log streaming that outlives a pod's absence (finding 8), a vcjob that never outlives its
driver (finding 9), and where the namespace comes from."""

from __future__ import annotations

import pytest

from components import k8s


def test_namespace_is_the_configured_one_else_the_pods_own(tmp_path, monkeypatch):
    """Multi-user Kubeflow (finding 10): null means the namespace the pod runs in, read from
    the service-account mount; outside a pod that is an error naming the setting."""
    mounted = tmp_path / "namespace"
    monkeypatch.setattr(k8s, "IN_CLUSTER_NAMESPACE", mounted)
    with pytest.raises(ValueError, match=r"cluster\.namespace"):
        k8s.namespace(None)
    mounted.write_text("team-a\n")
    assert k8s.namespace(None) == "team-a"
    assert k8s.namespace("kubeflow") == "kubeflow"
