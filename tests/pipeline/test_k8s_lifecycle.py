"""A kubernetes-scheduler launch against the loopback API server (tests/pipeline/fake_k8s.py):
log streaming that outlives a pod's absence (finding 8), a vcjob that never outlives its
driver (finding 9), and where the namespace comes from."""

from __future__ import annotations

import os
import signal
import time

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


@pytest.fixture
def in_pod(tmp_path, monkeypatch):
    """Be driver pod `name` (KFP_POD_NAME/KFP_POD_UID, as KFP v2 sets them) in namespace team-a."""
    (tmp_path / "namespace").write_text("team-a\n")
    monkeypatch.setattr(k8s, "IN_CLUSTER_NAMESPACE", tmp_path / "namespace")

    def be(name: str) -> None:
        monkeypatch.setenv("KFP_POD_NAME", name)
        monkeypatch.setenv("KFP_POD_UID", f"uid-{name}")

    return be


def test_two_runs_of_one_config_never_delete_each_others_vcjob(launch_on, in_pod):
    """Issue 21: two drivers of one config (one job name, train-abc) each submit, then each
    relaunches after a failure. Each attempt is a vcjob of its own name, labelled with its
    launch and attempt and owned by its driver pod; a relaunch deletes its own launch's
    earlier attempt and never the other run's job (recorded DELETE calls)."""
    from components.launcher import run_once
    from tests.pipeline.fake_k8s import FakeK8s

    drivers = {f"driver-{d}": {"uid": f"uid-driver-{d}", "phase": "Running"} for d in "ab"}
    with FakeK8s(running_polls=0, pods=drivers) as api:
        a, b = launch_on(api), launch_on(api)
        assert a.name == b.name == "train-abc" and a.launch_id != b.launch_id

        def submit(launch, driver: str, attempt: int) -> str:
            in_pod(driver)
            run_once(launch, {"LIFTOFF_ATTEMPT": str(attempt)})
            return api.created[-1]

        a0 = submit(a, "driver-a", 0)
        b0 = submit(b, "driver-b", 0)
        assert api.deleted == [], "a first submit deleted another run's job"
        b1 = submit(b, "driver-b", 1)
        assert api.deleted == [b0]
        a1 = submit(a, "driver-a", 1)
        assert api.deleted == [b0, a0]
        assert sorted(api.jobs) == sorted([a1, b1])
    for name, launch, attempt in [(a0, a, 0), (b0, b, 0), (b1, b, 1), (a1, a, 1)]:
        assert name.startswith(f"train-abc-{launch.launch_id[-8:]}-a{attempt}-"), name
    for name, launch, attempt, driver in [(a1, a, 1, "a"), (b1, b, 1, "b")]:
        meta = api.jobs[name]["metadata"]
        assert meta["labels"] == {
            k8s.JOB_LABEL: "train-abc",
            k8s.LAUNCH_LABEL: launch.launch_id,
            k8s.ATTEMPT_LABEL: str(attempt),
        }
        assert meta["ownerReferences"] == [
            {"apiVersion": "v1", "kind": "Pod", "name": f"driver-{driver}", "uid": f"uid-driver-{driver}"}
        ]


def test_a_retried_driver_deletes_only_the_job_whose_driver_is_gone(launch_on, in_pod):
    """A KFP UI Retry after drivers that died without cancelling their jobs (A OOM-killed: its
    pod Failed; C's pod deleted): the retried driver, a launch of its own, deletes those two
    orphans before it submits, and leaves alone B's job (its driver pod Running) and a job
    whose driver is not known (no ownerReference: a driver outside the cluster)."""
    from components.launcher import run_once
    from tests.pipeline.fake_k8s import FakeK8s

    drivers = {f"driver-{d}": {"uid": f"uid-driver-{d}", "phase": "Running"} for d in ("a", "b", "c", "retry")}
    with FakeK8s(running_polls=0, pods=drivers) as api:
        jobs = {}
        for driver in ("a", "b", "c"):
            in_pod(f"driver-{driver}")
            run_once(launch_on(api), {})
            jobs[driver] = api.created[-1]
        unowned = launch_on(api)
        in_pod("")  # not a pod: no ownerReference
        run_once(unowned, {})
        jobs["unowned"] = api.created[-1]
        assert "ownerReferences" not in api.jobs[jobs["unowned"]]["metadata"]
        api.pods["driver-a"]["phase"] = "Failed"
        api.pods["driver-c"] = None  # deleted
        in_pod("driver-retry")
        run_once(launch_on(api), {})
        assert sorted(api.deleted) == sorted([jobs["a"], jobs["c"]])
        assert {jobs["b"], jobs["unowned"]} <= set(api.jobs)


def test_the_first_failing_pod_is_named_from_the_pod_logs(launch_on):
    """On Kubernetes the failure records come from the pod logs (each line after the API's
    timestamp): replica 1 raised NotFound first, replica 0 lost its peer 0.8 s later and is
    the replica the job status calls Failed; the one line names replica 1's NotFound."""
    from components import events
    from components.launcher import LaunchError, run_once
    from tests.pipeline.fake_k8s import FakeK8s

    def report(rank: int, at: float, kind: str, message: str) -> str:
        record = {"rank": str(rank), "time": at, "type": kind, "message": message}
        return f"[0]:2026-12-01 00:00:00,000 rank{rank} ERROR liftoff.failure: {events.line('rank_failed', **record)}"

    t = 1796214012.898
    logs = {
        1: ["replica says hello", report(1, t, "NotFound", "no version v7 of checkpoint/tiny in the store")],
        0: ["replica says hello", report(0, t + 0.8, "RuntimeError", "[pair.cc:553] Connection closed by peer")],
    }
    with FakeK8s(running_polls=0, fail_replica=0, replica_logs=logs) as api:
        with pytest.raises(LaunchError) as failed:
            run_once(launch_on(api), {})
    first = str(failed.value).splitlines()[0]
    clock = time.strftime("%H:%M:%S", time.localtime(t))
    assert first.startswith(
        f"train-abc ended FAILED; first failure: replica 1 rank 1 at {clock}.898: "
        "NotFound: no version v7 of checkpoint/tiny in the store "
        "(replica 0 rank 0 failed after it: RuntimeError: Connection closed by peer)"
    ), first


def test_a_pod_that_died_without_a_word_is_named_too(launch_on):
    """Replica 1's pod is lost with its node (its task Failed, nothing in its log); replica 0
    reports its lost connection. The line names replica 0's error and says replica 1 logged
    none of its own, rather than passing rank 0's symptom off as the whole story."""
    from components import events
    from components.launcher import LaunchError, run_once
    from tests.pipeline.fake_k8s import FakeK8s

    record = {"rank": "0", "time": 1796214013.5, "type": "RuntimeError", "message": "Connection closed by peer"}
    logs = {0: [f"rank0 ERROR liftoff.failure: {events.line('rank_failed', **record)}"], 1: ["replica says hello"]}
    with FakeK8s(running_polls=0, fail_replica=1, replica_logs=logs) as api:
        with pytest.raises(LaunchError) as failed:
            run_once(launch_on(api), {})
    first = str(failed.value).splitlines()[0]
    assert "first failure: replica 0 rank 0 at " in first and ": RuntimeError: Connection closed by peer; " in first
    assert "; replica 1 logged no error (its processes killed, or its node lost?); last log lines:" in first


def test_a_gang_that_never_fits_fails_the_attempt_naming_volcanos_reason(launch_on):
    """Issue 22: a job Volcano cannot place (its nodes excluded, a resource no node has) pends
    forever; after cluster.pending_timeout_s the launch fails with the PodGroup's Unschedulable
    message, its vcjob cancelled (not left in the queue to grab the GPUs later) and not
    relaunched, whatever cluster.max_restarts allows."""
    import dataclasses

    from components.launcher import LaunchError, run_app
    from tests.pipeline.fake_k8s import FakeK8s

    reason = (
        "2/2 tasks in gang unschedulable: pod group is not ready, 2 Pending, 2 minAvailable; "
        "Pending: 2 Insufficient nvidia.com/gpu"
    )
    with FakeK8s(unschedulable=reason) as api:
        launch = launch_on(api)
        cluster = dataclasses.replace(launch.cluster, pending_timeout_s=2.0, max_restarts=2)
        with pytest.raises(LaunchError) as failed:
            run_app(dataclasses.replace(launch, cluster=cluster))
    message = str(failed.value).splitlines()[0]
    assert message.startswith("train-abc still unscheduled after 2s (cluster.pending_timeout_s): PodGroup "), message
    assert f"NotEnoughResources: {reason}" in message and "PodGroupPending" in message
    assert [name for name, body in api.status_updates if body["status"]["state"]["phase"] == "Aborted"] == api.created
    assert len(api.created) == 1  # not relaunched (max_restarts=2): the same gang would pend again
    assert ("scheduling.volcano.sh", "podgroups", "list") in api.calls and ("", "events", "list") in api.calls
