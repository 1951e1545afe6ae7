"""A kubernetes-scheduler launch against the loopback API server (tests/pipeline/fake_k8s.py):
log streaming that outlives a pod's absence (finding 8), a vcjob that never outlives its
driver (finding 9), and where the namespace comes from."""

from __future__ import annotations

import os
import signal

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


@pytest.fixture
def launch_on(tmp_path, monkeypatch):
    """A 2-node train Launch on the kubernetes scheduler, with the kubeconfig pointed at `api`."""
    from components.config import Scheduler, defaults
    from tests.pipeline.fake_k8s import train_launch_on

    def launch(api):
        (tmp_path / "kubeconfig").write_text(api.kubeconfig())
        # where a kubeconfig is looked for ($KUBECONFIG is read once, when kubernetes is imported)
        monkeypatch.setattr("kubernetes.config.kube_config.KUBE_CONFIG_DEFAULT_LOCATION", str(tmp_path / "kubeconfig"))
        cluster = defaults(
            "cluster",
            scheduler=Scheduler.kubernetes,
            nodes=2,
            namespace="team-a",
            image="registry.example.com/liftoff:1",
        )
        return train_launch_on(cluster, tmp_path)

    return launch


def test_a_replica_that_crashed_before_its_log_could_be_read_still_names_its_error(launch_on):
    """Finding 8: every live read of replica 1's log fails (404: no pod yet, 400: container
    creating) and the job has ended Failed by the time the log exists; the driver's last read
    after the job ended still gets the replica's own exception into the LaunchError."""
    from components.launcher import LaunchError, run_once
    from tests.pipeline.fake_k8s import FAIL_LINE, FakeK8s

    with FakeK8s(running_polls=0, log_errors=(404, 400), fail_replica=1) as api:
        with pytest.raises(LaunchError) as failed:
            run_once(launch_on(api), {})
    message = str(failed.value)
    assert "ended FAILED; replica 1 failed" in message
    assert FAIL_LINE in message, message
    assert api.log_reads[1][:2] == [404, 400] and len(api.log_reads[1]) > 2, api.log_reads


@pytest.mark.parametrize(
    "signum, stopped_by",
    [(signal.SIGTERM, SystemExit), (signal.SIGINT, KeyboardInterrupt)],
    ids=["sigterm", "exception"],
)
def test_a_driver_stopped_while_it_follows_the_job_cancels_the_vcjob(launch_on, signum, stopped_by):
    """Finding 9: the driver pod is stopped with SIGTERM (KFP cancel, eviction), or anything
    raises in it, while the job runs; TorchX's cancel marks the vcjob Aborted (a jobs/status
    update) before the driver exits, so the job does not hold the GPUs on its own. The job
    would otherwise succeed a few polls later and nothing would be cancelled."""
    from components.launcher import run_once
    from tests.pipeline.fake_k8s import FakeK8s

    def stop(reads: int) -> None:
        if reads == 2:  # the job exists and the driver is following it
            os.kill(os.getpid(), signum)

    # SIGTERM's default would end pytest; a driver without its own handler ignores it here.
    # SIGINT raises KeyboardInterrupt (Python's own handler: an earlier local TorchX run in this
    # process may have installed TorchX's, which raises its SignalException instead)
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with FakeK8s(running_polls=6, on_status_read=stop) as api:
            with pytest.raises(stopped_by):
                run_once(launch_on(api), {})
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)
    (created,) = api.jobs
    assert [(name, body["status"]["state"]["phase"]) for name, body in api.status_updates] == [(created, "Aborted")]
    assert ("batch.volcano.sh", "jobs/status", "update") in api.calls
