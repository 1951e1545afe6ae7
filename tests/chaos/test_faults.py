"""Faults during a run: a killed launcher, an S3 outage mid-publish, a full checkpoint disk."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from components import checkpoint_format as ckpt
from components.config import StoreBackend, defaults
from components.launcher import LaunchError
from components.store import Ref, StoreUnreachable, open_store
from tests.chaos.conftest import TcpProxy, descendants, kill_tree
from tests.conftest import CORPUS, Trainer
from tests.faults import fault_env
from tests.helpers import make_tree

# A small, fast run that still has the shipped default's shape: 2 nodes x 1 process, each node
# with its own disk, checkpoints joined from both nodes' parts in the store.
TRAIN = [
    f"data.paths=[{CORPUS}]",
    "cluster.nodes=2",
    "train.precision=fp32",
    "train.activation_checkpointing=off",
    "model.hidden_size=32",
    "model.ffn_hidden_size=96",
    "train.steps=8",
    "train.warmup_steps=1",
    "train.checkpoint_interval=2",
    "train.val_interval=0",
    "train.log_interval=1",
]
HANG_STEP = 7  # the killed run's rank 0 stops here, so the launcher is killed mid-run whatever the machine's speed

# The launcher as a process of its own, so the test can SIGKILL it. LEASE_TTL_S, when given,
# shortens the run's lease in the store (one run per identity): a launcher killed without
# releasing it blocks a rerun until it expires, 120 s by default.
RUN_TRAIN = """
import os, sys
from omegaconf import OmegaConf
from components.config import compose, defaults
from components.store import open_store
from components.train import stage
from components.train.stage import run_train
if os.environ.get("LEASE_TTL_S"):
    assert hasattr(stage, "LEASE_TTL_S"), "the train stage's lease ttl is gone: update this test"
    stage.LEASE_TTL_S = float(os.environ["LEASE_TTL_S"])
store_root, run_dir, dataset, *overrides = sys.argv[1:]
cfg = OmegaConf.to_object(compose([f"train.run_dir={run_dir}", *overrides]))
store_cfg = defaults("store", root=store_root, cache_dir=store_root + "-cache")
result = run_train(
    dataset, cfg.model, cfg.train, cfg.cluster, store_cfg, open_store(store_cfg), cache_gb=cfg.data.cache_gb
)
print("RESULT", open_store(store_cfg).fetch(result.model))
print("RESUMED", result.result.resumed_from, result.result.start_step)
"""


ROOT = Path(__file__).resolve().parents[2]


def launch(trainer: Trainer, run_dir: Path, *overrides: str, env: dict | None = None) -> subprocess.Popen:
    script = trainer.tmp / "run_train.py"
    script.write_text(RUN_TRAIN)
    return subprocess.Popen(
        [sys.executable, str(script), trainer.store_cfg.root, str(run_dir), trainer.dataset, *TRAIN, *overrides],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},  # tests.faults importable, as under pytest
    )


def finished(proc: subprocess.Popen) -> tuple[dict, str | None, int]:
    """(the exported weights, the checkpoint it resumed from or None, the step it resumed at)."""
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    export = Path(out.rsplit("RESULT ", 1)[1].split()[0])
    resumed_from, start_step = out.rsplit("RESUMED ", 1)[1].split()[:2]
    weights = load_file(str(export / "model.safetensors"))
    return weights, None if resumed_from == "None" else resumed_from, int(start_step)


def stored_checkpoints(trainer: Trainer) -> dict[str, int]:
    """{checkpoint/NAME@VERSION: its step} of every checkpoint version the store holds."""
    return {str(m.ref): int(m.metadata["step"]) for m in trainer.store.versions("checkpoint", "tiny")}


def wait_gone(pids: list[int], timeout_s: float = 30) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [p for p in pids if Path(f"/proc/{p}").exists() and not _zombie(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False


@pytest.mark.chaos_slow  # 47 s: in `make chaos`; tests/test_local_pod.py kills a node in `make test`
def test_killed_launcher_rerun_resumes_from_the_store_to_identical_weights(dataset_store, tmp_path, chaos):
    rec = chaos(
        "training launcher SIGKILLed mid-run (2 nodes), then rerun on a fresh machine (node disks and caches wiped)",
        "resume from the newest checkpoint in the store; same final weights as an uninterrupted run",
    )
    clean = Trainer(dataset_store, tmp_path / "clean")
    clean_weights, clean_resumed, _ = finished(launch(clean, tmp_path / "clean-runs"))
    assert clean_resumed is None

    trainer = Trainer(dataset_store, tmp_path / "killed")
    ttl = 5.0
    killed_env = {**fault_env(hang_rank=0, hang_step=HANG_STEP), "LEASE_TTL_S": str(ttl)}
    proc = launch(trainer, tmp_path / "runs-1", env=killed_env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if any(step >= 4 for step in stored_checkpoints(trainer).values()):
            break
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()[0][-3000:]  # still running: killed mid-run
    tree = [proc.pid, *descendants(proc.pid)]
    kill_tree(proc.pid)
    proc.communicate()
    assert wait_gone(tree) == []
    killed_at = time.monotonic()
    stored = stored_checkpoints(trainer)
    newest = max(stored, key=stored.get, default=None)
    assert newest is not None and 4 <= stored[newest] < HANG_STEP, stored

    # a fresh machine: no node disk (run dir, local checkpoints) and no store cache survives
    shutil.rmtree(tmp_path / "runs-1")
    shutil.rmtree(trainer.store_cfg.root + "-cache", ignore_errors=True)
    time.sleep(max(0.0, killed_at + ttl + 1 - time.monotonic()))  # the killed launcher's lease expires
    weights, resumed_from, start_step = finished(launch(trainer, tmp_path / "runs-2"))
    assert (resumed_from, start_step) == (newest, stored[newest])
    assert weights.keys() == clean_weights.keys()
    differ = [k for k in weights if not torch.equal(weights[k], clean_weights[k])]
    assert differ == [], differ
    rec.happened(
        f"killed mid-run (8 steps, rank 0 held at step {HANG_STEP}) with steps {sorted(stored.values())} stored; "
        "the rerun on wiped disks "
        f"resumed from the store at step {start_step}; final weights bitwise identical to an uninterrupted run"
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


@pytest.mark.chaos_slow
def test_a_killed_rank_of_fsdp_fp8_compiled_training_resumes_to_identical_weights(dataset_store, tmp_path):
    """Rank 1 SIGKILLs itself at step 15 under FSDP2 with fp8 all-gather, activation checkpointing
    and compiled blocks; the relaunch resumes from step 10 to the weights of an uninterrupted run
    (within 1e-6), and the trained model has every wrapper (tests/train/test_training.py)."""
    from tests.helpers import FSDP_FP8_AC_COMPILE, killed_rank_resumes_to_identical_weights

    killed_rank_resumes_to_identical_weights(dataset_store, tmp_path, FSDP_FP8_AC_COMPILE)
