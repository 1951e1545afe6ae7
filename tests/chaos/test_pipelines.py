"""Whole pipelines under stress: secrets never leak; two pipelines share one store."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from components.config import StoreBackend, defaults
from components.store import Ref, open_store
from pipelines.cli import main
from tests.conftest import S3_ACCESS_KEY, S3_SECRET_KEY
from tests.helpers import FAST


@pytest.mark.chaos_slow  # 68 s, a whole run over S3: in `make chaos`, out of `make test`
def test_sentinel_credentials_appear_nowhere(s3_endpoint, s3_env, tmp_path, monkeypatch, capfd, caplog, chaos):
    rec = chaos(
        "whole tiny pipeline with sentinel MinIO credentials",
        "the credentials appear in no log, artifact, metrics file or compiled YAML",
    )
    caplog.set_level("DEBUG")
    monkeypatch.chdir(tmp_path)
    bucket = f"secrets-{uuid.uuid4().hex[:8]}"
    assert main(["run", *FAST, "store=minio", f"store.bucket={bucket}"]) == 0
    assert main(["compile", "store=minio"]) == 0
    captured = capfd.readouterr()
    texts = {"stdout": captured.out, "stderr": captured.err, "log records": caplog.text}
    scanned = 0
    for path in tmp_path.rglob("*"):
        if path.is_file():
            texts[str(path)] = path.read_bytes().decode("utf-8", "replace")
            scanned += 1
    store = open_store(defaults("store", backend=StoreBackend.minio, bucket=bucket, cache_dir=str(tmp_path / "scan")))
    for obj in store.backend.client.list_objects(bucket, recursive=True):
        resp = store.backend.client.get_object(bucket, obj.object_name)
        texts[f"s3://{bucket}/{obj.object_name}"] = resp.read().decode("utf-8", "replace")
        resp.close()
        scanned += 1
    leaks = [where for where, text in texts.items() if S3_SECRET_KEY in text or S3_ACCESS_KEY in text]
    assert leaks == []
    assert (tmp_path / "build" / "pretrain.yaml").is_file() and scanned > 20
    rec.happened(f"scanned {scanned} files and objects plus all output: no leak")


@pytest.mark.chaos_slow
def test_two_pipelines_at_once_against_one_store(tmp_path, chaos):
    rec = chaos(
        "two pipelines run at once against one store",
        "no interference: both succeed, distinct versions, both lineages correct",
    )
    store_root = tmp_path / "shared-store"
    procs = []
    for lr in ("0.001", "0.003"):
        cwd = tmp_path / f"run-{lr}"
        cwd.mkdir()
        args = [
            str(Path(sys.executable).parent / "liftoff"),
            "run",
            *FAST,
            f"train.lr={lr}",
            f"store.root={store_root}",
            f"store.cache_dir={cwd / 'cache'}",
        ]
        procs.append(subprocess.Popen(args, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=900)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[-2000:] for o in outputs]
    store = open_store(defaults("store", root=str(store_root), cache_dir=str(tmp_path / "c")))
    models = store.versions("model", "tiny")
    datasets = store.versions("dataset", "kjv")
    assert len(models) == 2 and len(datasets) == 1
    lrs = set()
    for m in models:
        ckpt = next(p for p in m.parents if p.startswith("checkpoint/"))
        assert str(datasets[0].ref) in m.parents and ckpt.split("@")[1].startswith(m.metadata["identity"])
        assert store.exists(Ref.parse(ckpt))
        lrs.add(m.metadata["train"]["lr"])
    assert lrs == {0.001, 0.003}
    evals = store.versions("eval", "tiny")
    assert {next(p for p in e.parents if p.startswith("model/")) for e in evals} == {str(m.ref) for m in models}
    rec.happened(f"2 models {[m.ref.version for m in models]} on 1 dataset, each with its own checkpoint and eval")
