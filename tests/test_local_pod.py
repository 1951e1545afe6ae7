"""Local mode simulates a cluster's pod boundaries: each TorchX replica ("node") runs in its
own directory with only the environment its Kubernetes spec declares; nothing crosses
between nodes, or from the driver, except through the store."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from components.config import StoreBackend, defaults
from components.launcher import QUIET_WARNINGS, Launch, LaunchError, run_app
from tests.conftest import ROOT, S3_ACCESS_KEY, S3_SECRET_KEY, Trainer
from tests.faults import injected
from tests.helpers import TWO_NODES
from tests.pod_probe import ProbeSpec


def test_each_node_has_its_own_directory_and_only_its_declared_environment(tmp_path, s3_env, monkeypatch):
    monkeypatch.setenv("LIFTOFF_DRIVER_ONLY_SENTINEL", "leaked")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "driver-file").write_text("on the driver's disk")
    store = defaults("store", backend=StoreBackend.minio, root="", secret_name="liftoff-minio")
    spec = ProbeSpec(store, driver_file="driver-file")  # relative: a path on the driver's disk
    cluster = defaults("cluster", nodes=2)
    run_app(
        Launch("tests.pod_probe", spec, cluster, "probe", tmp_path / "logs", tmp_path / "nodes"),
        {"PYTHONPATH": str(ROOT)},
    )
    for node in (0, 1):
        node_dir = tmp_path / "nodes" / str(node)
        seen = json.loads((node_dir / f"pod-{node}.json").read_text())
        env = seen["env"]
        assert Path(seen["cwd"]) == node_dir.resolve() and env["HOME"] == str(node_dir.resolve())
        assert env["TMPDIR"] == str(node_dir.resolve() / "tmp")
        assert "LIFTOFF_DRIVER_ONLY_SENTINEL" not in env and not seen["driver_dir_visible"]
        # the store's keys arrive as a Secret would put them, not inherited from the driver
        assert env["MINIO_ACCESS_KEY"] == S3_ACCESS_KEY and env["MINIO_SECRET_KEY"] == S3_SECRET_KEY
        assert env["NODE_NAME"].endswith(f"-node{node}") and env["OMP_NUM_THREADS"] == "1"
        assert env["PYTHONWARNINGS"] == QUIET_WARNINGS  # declared, as on Kubernetes
    assert not (tmp_path / "nodes" / "secret.json").exists()  # the Secret's stand-in is gone after the job


def test_without_a_minio_secret_no_store_key_reaches_a_node(tmp_path, s3_env):
    spec = ProbeSpec(defaults("store"), driver_file=str(tmp_path / "nothing"))
    run_app(
        Launch("tests.pod_probe", spec, defaults("cluster"), "probe", tmp_path / "logs", tmp_path / "nodes"),
        {"PYTHONPATH": str(ROOT)},
    )
    env = json.loads((tmp_path / "nodes" / "0" / "pod-0.json").read_text())["env"]
    assert not any(k.startswith("MINIO_") for k in env)


def _kill_node_when_stored(trainer: Trainer, nodes: Path, node: int, step: int, killed: list) -> None:
    """SIGKILL every process of one local node (what a lost machine looks like) once the
    checkpoint of `step` is in the store."""
    deadline = time.monotonic() + 300
    target = (nodes / str(node)).resolve()
    while time.monotonic() < deadline and not killed:
        if any(m.metadata.get("step") == step for m in trainer.store.versions("checkpoint", "tiny")):
            for pid in [p for p in os.listdir("/proc") if p.isdigit()]:
                try:
                    if Path(f"/proc/{pid}/cwd").resolve() == target:
                        os.kill(int(pid), signal.SIGKILL)
                        killed.append(int(pid))
                except (FileNotFoundError, ProcessLookupError, PermissionError):
                    continue
        time.sleep(0.2)


def test_a_killed_node_and_wiped_disks_resume_from_the_store_to_identical_weights(dataset_store, tmp_path):
    """2 nodes, fp8 + activation checkpointing: node 1 dies whole (its agent and worker) after
    step 10 is stored; the job fails. Every node directory is wiped (new machines), and the
    rerun resumes from the store at step 10, to the weights of an uninterrupted run."""
    common = [*TWO_NODES, "train.precision=fp8", "train.activation_checkpointing=full", "train.steps=30"]
    common += ["train.checkpoint_interval=10"]
    clean = Trainer(dataset_store, tmp_path / "clean").run(*common)
    trainer = Trainer(dataset_store, tmp_path / "killed")
    run_dir = trainer.tmp / "runs" / clean.identity
    killed: list[int] = []
    killer = threading.Thread(target=_kill_node_when_stored, args=(trainer, run_dir / "nodes", 1, 10, killed))
    killer.start()
    with pytest.raises(LaunchError), injected(slow_rank=0, slow_seconds=0.3):
        trainer.run(*common)
    killer.join()
    assert killed, "node 1 was never killed"
    shutil.rmtree(run_dir / "nodes")
    again = trainer.run(*common)
    from components.plots import read_records

    steps, events = read_records(again.metrics)
    start = [e for e in events if e["kind"] == "start"][-1]
    assert start["step"] >= 10 and start["resumed_from"]
    # the run's history came back with the checkpoint: every step once, from step 1
    assert [s["step"] for s in steps] == list(range(1, 31))
    a, b = load_file(str(clean.export / "model.safetensors")), load_file(str(again.export / "model.safetensors"))
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6
