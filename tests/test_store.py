"""The store contract, run against the local backend and MinIO over real HTTP (moto)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from components.config import StoreBackend, defaults
from components.store import (
    MANIFEST,
    IntegrityError,
    InvalidKey,
    NotFound,
    Ref,
    StoreUnreachable,
    open_store,
)
from tests.conftest import free_port


def make_tree(root: Path, seed: str) -> Path:
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text(f"alpha {seed}")
    (root / "sub" / "b.bin").write_bytes(seed.encode() * 1000)
    return root


def test_publish_resolve_fetch_roundtrip(store, tmp_path):
    src = make_tree(tmp_path / "src", "v1")
    m = store.publish("dataset", "corpus", "abc123", src, metadata={"tokens": 42})
    assert set(m.files) == {"a.txt", "sub/b.bin"}
    got = store.resolve("dataset", "corpus", "latest")
    assert got.ref == Ref("dataset", "corpus", "abc123") and got.metadata == {"tokens": 42}
    out = store.fetch(got)
    assert (out / "a.txt").read_text() == "alpha v1"
    assert (out / "sub" / "b.bin").read_bytes() == b"v1" * 1000
    assert [str(x.ref) for x in store.ls("dataset")] == ["dataset/corpus@abc123"]


def test_latest_is_newest_and_versions_are_immutable(store, tmp_path):
    store.publish("model", "m", "run-step1", make_tree(tmp_path / "one", "1"))
    time.sleep(0.01)
    store.publish("model", "m", "run-step2", make_tree(tmp_path / "two", "2"))
    assert store.resolve("model", "m").ref.version == "run-step2"
    again = store.publish("model", "m", "run-step1", make_tree(tmp_path / "three", "3"))
    assert (store.fetch(again) / "a.txt").read_text() == "alpha 1"  # republish did not overwrite


def test_lineage_follows_parents(store, tmp_path):
    store.publish("dataset", "d", "h1", make_tree(tmp_path / "d", "d"))
    store.publish("checkpoint", "c", "r-step5", make_tree(tmp_path / "c", "c"), parents=["dataset/d@h1"])
    store.publish("model", "m", "r", make_tree(tmp_path / "m", "m"), parents=["checkpoint/c@r-step5"])
    tree = store.lineage(Ref("model", "m", "r"))
    assert tree["ref"] == "model/m@r"
    assert tree["parents"][0]["ref"] == "checkpoint/c@r-step5"
    assert tree["parents"][0]["parents"][0]["ref"] == "dataset/d@h1"


class FailAfter:
    """Wraps a backend; the n-th put raises, as a crash or network cut mid-upload would."""

    def __init__(self, inner, n: int):
        self.inner, self.n = inner, n
        self.description = inner.description

    def _tick(self):
        self.n -= 1
        if self.n < 0:
            raise ConnectionError("injected failure mid-upload")

    def put_file(self, key, path):
        self._tick()
        self.inner.put_file(key, path)

    def put_bytes(self, key, data):
        self._tick()
        self.inner.put_bytes(key, data)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("fail_at", [0, 1, 2])
def test_interrupted_publish_leaves_no_version(store, tmp_path, fail_at):
    store.publish("dataset", "d", "good", make_tree(tmp_path / "good", "g"))
    real = store.backend
    store.backend = FailAfter(real, fail_at)
    with pytest.raises(ConnectionError):
        store.publish("dataset", "d", "partial", make_tree(tmp_path / "partial", "p"))
    store.backend = real
    assert not store.exists(Ref("dataset", "d", "partial"))
    assert [m.ref.version for m in store.versions("dataset", "d")] == ["good"]
    assert store.resolve("dataset", "d").ref.version == "good"
    # and a retry of the same publish completes it
    store.publish("dataset", "d", "partial", make_tree(tmp_path / "again", "p"))
    assert store.resolve("dataset", "d", "partial").files


def test_corrupted_object_is_detected_on_fetch(store, tmp_path):
    m = store.publish("dataset", "d", "v", make_tree(tmp_path / "src", "x"))
    store.backend.put_bytes("dataset/d/v/sub/b.bin", b"tampered")
    with pytest.raises(IntegrityError, match="dataset/d/v/sub/b.bin"):
        store.fetch(m, tmp_path / "out")


def test_invalid_manifest_makes_version_invisible(store, tmp_path):
    store.publish("dataset", "d", "v1", make_tree(tmp_path / "src", "x"))
    store.backend.put_bytes("dataset/d/v2/a.txt", b"orphan")
    store.backend.put_bytes(f"dataset/d/v2/{MANIFEST}", b"{not json")
    assert [m.ref.version for m in store.versions("dataset", "d")] == ["v1"]
    with pytest.raises(IntegrityError, match="invalid manifest"):
        store.resolve("dataset", "d", "v2")


@pytest.mark.parametrize("bad", ["..", "a/b", "", "/abs", "x\\y", ".hidden"])
def test_bad_key_parts_are_refused(store, tmp_path, bad):
    with pytest.raises(InvalidKey):
        store.publish("dataset", bad, "v", make_tree(tmp_path / "src", "x"))


def test_missing_version_is_a_clear_error(store):
    with pytest.raises(NotFound, match="dataset/nothing"):
        store.resolve("dataset", "nothing")


def test_bucket_has_versioning_and_overwrites_are_kept(s3_env, tmp_path):
    from minio.commonconfig import ENABLED

    from tests.conftest import store_config

    store = open_store(store_config("minio", tmp_path))
    backend = store.backend
    assert backend.client.get_bucket_versioning(backend.bucket).status == ENABLED
    backend.put_bytes("k/obj", b"one")
    backend.put_bytes("k/obj", b"two")
    versions = list(backend.client.list_objects(backend.bucket, prefix="k/obj", include_version=True))
    assert len(versions) == 2


def test_unreachable_endpoint_fails_in_bounded_time_naming_it(monkeypatch, tmp_path):
    port = free_port()  # nothing listens here
    monkeypatch.setenv("MINIO_ACCESS_KEY", "a")
    monkeypatch.setenv("MINIO_SECRET_KEY", "b")
    cfg = defaults(
        "store",
        backend=StoreBackend.minio,
        endpoint=f"127.0.0.1:{port}",
        secure=False,
        timeout_s=2.0,
        cache_dir=str(tmp_path),
    )
    start = time.monotonic()
    with pytest.raises(StoreUnreachable, match=f"127.0.0.1:{port}"):
        open_store(cfg)
    assert time.monotonic() - start < 10


def test_local_store_never_writes_outside_its_root(tmp_path):
    store = open_store(defaults("store", root=str(tmp_path / "root"), cache_dir=str(tmp_path / "c")))
    with pytest.raises(InvalidKey):
        store.backend.put_bytes("../escape", b"x")
    assert not (tmp_path / "escape").exists()


def test_manifest_records_lineage_code_and_hashes(store, tmp_path):
    m = store.publish("dataset", "d", "v", make_tree(tmp_path / "src", "x"), parents=["dataset/raw@r1"])
    raw = json.loads(store.backend.get_bytes(f"dataset/d/v/{MANIFEST}"))
    assert raw["parents"] == ["dataset/raw@r1"]
    assert raw["code_version"] and raw["created"]
    assert raw["files"]["a.txt"]["size"] == len("alpha x") and len(raw["files"]["a.txt"]["sha256"]) == 64
    assert m.files == raw["files"]


def test_cli_artifacts_ls_and_show_trace_lineage(tmp_path, capsys):
    from pipelines.cli import main

    cfg = defaults("store", root=str(tmp_path / "store"), cache_dir=str(tmp_path / "c"))
    store = open_store(cfg)
    store.publish("dataset", "d", "h1", make_tree(tmp_path / "d", "d"))
    store.publish("model", "m", "r1", make_tree(tmp_path / "m", "m"), parents=["dataset/d@h1"])
    args = [f"store.root={cfg.root}", f"store.cache_dir={cfg.cache_dir}"]
    assert main(["artifacts", "ls", *args]) == 0
    listed = capsys.readouterr().out
    assert "dataset/d@h1" in listed and "model/m@r1" in listed
    assert main(["artifacts", "show", "model/m", *args]) == 0
    shown = capsys.readouterr().out
    assert shown.startswith("model/m@r1\n") and "      dataset/d@h1  created " in shown


def test_a_version_uploaded_in_parts_is_visible_only_once_every_part_is_in(store, tmp_path):
    """How the ranks of a checkpoint publish: each uploads its own files; the commit (the
    manifest) names every rank's and is refused while any part is missing."""
    from components.store import sha256_file

    parts = {}
    for rank in (0, 1):
        path = tmp_path / f"__{rank}_0.distcp"
        path.write_bytes(bytes([rank]) * 1000)
        parts[path.name] = path
    ref = Ref("checkpoint", "m", "step10-abc")
    mine = store.upload(ref, {"__0_0.distcp": parts["__0_0.distcp"]})
    theirs = {"__1_0.distcp": {"sha256": sha256_file(parts["__1_0.distcp"]), "size": 1000}}
    with pytest.raises(IntegrityError, match="__1_0.distcp"):
        store.commit(ref, {**mine, **theirs})
    assert not store.exists(ref) and store.versions("checkpoint", "m") == []
    store.upload(ref, {"__1_0.distcp": parts["__1_0.distcp"]})
    manifest = store.commit(ref, {**mine, **theirs}, metadata={"step": 10})
    out = store.fetch(manifest, tmp_path / "joined")
    assert (out / "__1_0.distcp").read_bytes() == bytes([1]) * 1000 and (out / "__0_0.distcp").is_file()
