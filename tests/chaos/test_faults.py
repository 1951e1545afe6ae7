"""Faults during a run: a killed launcher, an S3 outage mid-publish, a full checkpoint disk."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from safetensors.torch import load_file

from components import checkpoint_format as ckpt
from components.config import StoreBackend, defaults
from components.launcher import LaunchError
from components.store import Ref, StoreUnreachable, open_store
from tests.chaos.conftest import TcpProxy, kill_tree
from tests.conftest import CORPUS, Trainer
from tests.faults import fault_env
from tests.test_store import make_tree

TRAIN = [f"data.paths=[{CORPUS}]", "train.steps=30", "train.checkpoint_interval=10", "train.log_interval=1"]

RUN_TRAIN = """
import sys
from omegaconf import OmegaConf
from components.config import compose, defaults
from components.store import open_store
from components.train.stage import run_train
store_root, run_dir, dataset, *overrides = sys.argv[1:]
cfg = OmegaConf.to_object(compose([f"train.run_dir={run_dir}", *overrides]))
store_cfg = defaults("store", root=store_root, cache_dir=store_root + "-cache")
result = run_train(
    dataset, cfg.model, cfg.train, cfg.cluster, store_cfg, open_store(store_cfg), cache_gb=cfg.data.cache_gb
)
print("RESULT", open_store(store_cfg).fetch(result.model))
"""


def launch(trainer: Trainer, run_dir: Path, *overrides: str, env: dict | None = None) -> subprocess.Popen:
    script = trainer.tmp / "run_train.py"
    script.write_text(RUN_TRAIN)
    return subprocess.Popen(
        [sys.executable, str(script), trainer.store_cfg.root, str(run_dir), trainer.dataset, *TRAIN, *overrides],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
        env={**os.environ, **(env or {})},
    )


def export_of(proc: subprocess.Popen) -> Path:
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    return Path(out.rsplit("RESULT ", 1)[1].split()[0])


@pytest.mark.chaos_slow
def test_killed_launcher_rerun_resumes_from_the_store_to_identical_weights(dataset_store, tmp_path, chaos):
    rec = chaos(
        "training launcher SIGKILLed mid-run, then rerun on a fresh machine",
        "resume from the newest checkpoint in the store; same final weights as an uninterrupted run",
    )
    clean = Trainer(dataset_store, tmp_path / "clean")
    clean_weights = load_file(str(export_of(launch(clean, tmp_path / "clean-runs")) / "model.safetensors"))

    trainer = Trainer(dataset_store, tmp_path / "killed")
    proc = launch(trainer, tmp_path / "runs-1", env=fault_env(slow_rank=0, slow_seconds=0.2))
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if any(m.metadata.get("step") == 10 for m in trainer.store.versions("checkpoint", "tiny")):
            break
        time.sleep(0.5)
    kill_tree(proc.pid)
    proc.wait()
    stored = sorted(m.metadata["step"] for m in trainer.store.versions("checkpoint", "tiny"))
    assert stored and stored[-1] < 30, stored
    rerun = launch(trainer, tmp_path / "runs-2")  # a new pod: nothing local, the store has the checkpoints
    weights = load_file(str(export_of(rerun) / "model.safetensors"))
    start = [
        json.loads(x)
        for x in (next((tmp_path / "runs-2").iterdir()) / "nodes/0/run/metrics.jsonl").read_text().splitlines()
        if '"kind": "start"' in x
    ][0]
    assert start["step"] == stored[-1]
    diff = max(float((weights[k] - clean_weights[k]).abs().max()) for k in weights)
    assert diff <= 1e-6
    rec.happened(
        f"killed after step {stored[-1]} was stored; rerun resumed at step {start['step']}; "
        f"max |weight diff| {diff:.1e}"
    )


def test_s3_outage_during_publish_then_recovery(s3_endpoint, s3_env, tmp_path, chaos):
    rec = chaos(
        "S3 endpoint goes down in the middle of a publish",
        "bounded retries, a clear error naming the endpoint, no half-written version; success after restart",
    )
    proxy = TcpProxy(int(s3_endpoint.rsplit(":", 1)[1]))
    proxy.start()
    bucket = f"outage-{uuid.uuid4().hex[:8]}"
    cfg = defaults(
        "store",
        backend=StoreBackend.minio,
        endpoint=f"127.0.0.1:{proxy.port}",
        bucket=bucket,
        secure=False,
        timeout_s=3.0,
        cache_dir=str(tmp_path / "cache"),
    )
    store = open_store(cfg)
    store.publish("dataset", "d", "good", make_tree(tmp_path / "good", "g"))
    backend = store.backend
    real_put = backend.put_file

    def put_then_outage(key, path):
        real_put(key, path)
        proxy.stop()

    backend.put_file = put_then_outage
    start = time.monotonic()
    with pytest.raises(StoreUnreachable, match=f"127.0.0.1:{proxy.port}") as err:
        store.publish("dataset", "d", "partial", make_tree(tmp_path / "partial", "p"))
    waited = time.monotonic() - start
    assert waited < 15
    backend.put_file = real_put
    direct = open_store(
        defaults(
            "store",
            backend=StoreBackend.minio,
            endpoint=s3_endpoint,
            bucket=bucket,
            secure=False,
            cache_dir=str(tmp_path / "c2"),
        )
    )
    assert [m.ref.version for m in direct.versions("dataset", "d")] == ["good"]
    assert direct.resolve("dataset", "d").ref.version == "good"
    proxy.start()  # the endpoint comes back on the same port
    store.publish("dataset", "d", "partial", make_tree(tmp_path / "again", "p"))
    assert sorted(m.ref.version for m in direct.versions("dataset", "d")) == ["good", "partial"]
    assert (direct.fetch(direct.manifest(Ref("dataset", "d", "partial"))) / "a.txt").read_text() == "alpha p"
    proxy.stop()
    rec.happened(f"failed after {waited:.1f}s: {str(err.value)[:80]}...; only 'good' visible; republish succeeded")


def test_full_checkpoint_disk_fails_clearly_and_keeps_earlier_checkpoints(trainer, tmp_path, chaos):
    rec = chaos(
        "checkpoint disk fills up (a 7 MB tmpfs)",
        "a clear error naming the checkpoint and the free space; earlier checkpoints intact",
    )
    disk = tmp_path / "small-disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=7m", "tmpfs", str(disk)], check=True)
    try:
        with pytest.raises(LaunchError) as err:
            trainer.run(
                "train.steps=40",
                "train.checkpoint_interval=10",
                "train.checkpoint_keep=5",
                f"train.checkpoint_dir={disk}",
            )
        message = str(err.value)
        assert "could not be written to" in message and "MB free" in message
        assert "earlier checkpoints are intact" in message
        root = next(disk.iterdir()) / "node0"
        kept = ckpt.local_checkpoints(root)
        assert kept and all(ckpt.verify(c)["step"] == ckpt.step_of(c) for c in kept)
        assert not list(root.glob("*.tmp"))
        rec.happened(f"{message.splitlines()[0][:140]}...; {[c.name for c in kept]} verify")
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
