"""The store contract, run against the local backend and MinIO over real HTTP (moto)."""

from __future__ import annotations

import hashlib
import json
import time

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
from tests.helpers import make_tree


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


def test_an_existing_bucket_is_used_as_it_is_never_reconfigured(s3_env, tmp_path):
    """Issue 22: a bucket made by a deploy step (or KFP's own) is opened without make_bucket or
    a versioning change, the calls a least-privilege user may not make: the bucket made here with
    versioning off still has it off after liftoff opened it and published into it."""
    from components.store.connection import Connection
    from tests.conftest import store_config

    cfg = store_config("minio", tmp_path)
    client = Connection.from_config(cfg).client()
    client.make_bucket(cfg.bucket)
    assert client.get_bucket_versioning(cfg.bucket).status in (None, "Off")  # never enabled
    store = open_store(cfg)
    store.publish("dataset", "kept", "v1", make_tree(tmp_path / "src", "x"))
    assert client.get_bucket_versioning(cfg.bucket).status in (None, "Off")  # never enabled
    assert store.resolve("dataset", "kept").ref.version == "v1"


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


def test_get_range_reads_a_slice_clamped_at_the_end(store):
    data = bytes(range(256)) * 4
    store.backend.put_bytes("k/blob", data)
    assert store.backend.get_range("k/blob", 100, 50) == data[100:150]
    assert store.backend.get_range("k/blob", 0, 1) == data[:1]
    assert store.backend.get_range("k/blob", 1000, 100) == data[1000:]  # runs past the end: what is there
    assert store.backend.get_range("k/blob", 1024, 10) == b""  # starts at the end
    assert store.backend.get_range("k/blob", 5000, 10) == b""  # starts past it
    assert store.backend.get_range("k/blob", 10, 0) == b""
    for length in (1, 0):
        with pytest.raises(NotFound, match="k/missing"):
            store.backend.get_range("k/missing", 0, length)
    with pytest.raises(ValueError, match="offset=-1"):
        store.backend.get_range("k/blob", -1, 10)


def test_read_range_reads_one_file_of_a_version(store, tmp_path):
    m = store.publish("shard", "corpus", "h1-00003", make_tree(tmp_path / "src", "x7"))
    whole = b"x7" * 1000
    assert store.read_range(m, "sub/b.bin", 10, 21) == whole[10:31]
    assert store.read_range(m, "sub/b.bin", 1990, 100) == whole[1990:]  # clamped to the file's size
    assert store.read_range(m, "sub/b.bin", 2000, 5) == b""
    assert store.read_range(m, "a.txt", 0, 1 << 20) == b"alpha x7"
    with pytest.raises(NotFound, match="shard/corpus/h1-00003/nope.bin"):
        store.read_range(m, "nope.bin", 0, 1)
    store.backend.put_bytes("shard/corpus/h1-00003/sub/b.bin", b"short")  # shorter than its manifest says
    with pytest.raises(IntegrityError, match="shard/corpus/h1-00003/sub/b.bin"):
        store.read_range(m, "sub/b.bin", 0, 100)


def test_the_tokenize_kinds_are_known():
    from components.store import KINDS

    assert {"dataset", "shard", "tokenizer"} <= set(KINDS)


@pytest.fixture
def source(s3_env, tmp_path):
    """An s3:// source on the store's endpoint: a bucket of corpus files, and its reader."""
    import io
    import uuid

    from components.store import object_source
    from tests.conftest import store_config

    src = object_source(store_config("minio", tmp_path))
    bucket = f"src-{uuid.uuid4().hex[:12]}"
    src.client.make_bucket(bucket)
    objects = {
        "corpus/b.jsonl": b'{"text": "bee"}\n',
        "corpus/a.jsonl": b'{"text": "ay"}\n' * 3,
        "corpus/sub/c.jsonl": b'{"text": "sea"}\n',
        "corpus2/not-under-corpus.jsonl": b"{}\n",
        "single.jsonl": b'{"text": "one"}\n',
        "dir": b"an object named like a folder\n",
        "dir/inside.jsonl": b"{}\n",
    }
    for key, data in objects.items():
        src.client.put_object(bucket, key, io.BytesIO(data), len(data))
    return src, bucket, objects


def test_object_source_lists_a_prefix_as_a_folder(source):
    src, bucket, objects = source
    for url in (f"s3://{bucket}/corpus", f"s3://{bucket}/corpus/"):
        listed = src.list(url)
        assert [o.key for o in listed] == ["corpus/a.jsonl", "corpus/b.jsonl", "corpus/sub/c.jsonl"]
        assert [o.relpath for o in listed] == ["a.jsonl", "b.jsonl", "sub/c.jsonl"]
        assert [o.size for o in listed] == [len(objects[o.key]) for o in listed]
        assert listed[0].url == f"s3://{bucket}/corpus/a.jsonl" and listed[0].bucket == bucket
        assert [o.etag for o in listed] == [hashlib.md5(objects[o.key]).hexdigest() for o in listed]
    assert len(src.list(f"s3://{bucket}")) == len(objects)  # the whole bucket


def test_object_source_lists_one_named_object(source):
    src, bucket, objects = source
    (one,) = src.list(f"s3://{bucket}/corpus/sub/c.jsonl")
    assert (one.key, one.relpath, one.size) == ("corpus/sub/c.jsonl", "c.jsonl", len(objects["corpus/sub/c.jsonl"]))
    (folderish,) = src.list(f"s3://{bucket}/dir")  # an object named exactly so wins over the folder
    assert folderish.key == "dir"
    assert [o.key for o in src.list(f"s3://{bucket}/dir/")] == ["dir/inside.jsonl"]


def test_object_source_refuses_what_is_not_there_naming_the_url(source):
    from components.store import InvalidKey, StoreError

    src, bucket, _ = source
    with pytest.raises(NotFound, match=f"s3://{bucket}/corp: no objects"):
        src.list(f"s3://{bucket}/corp")  # a prefix of names, not a folder
    with pytest.raises(StoreError, match="s3://no-such-bucket-here/corpus: bucket 'no-such-bucket-here' does not"):
        src.list("s3://no-such-bucket-here/corpus")
    with pytest.raises(InvalidKey, match="expected s3://BUCKET"):
        src.list("/data/corpus")


def test_object_source_downloads_the_bytes_it_listed(source, tmp_path):
    src, bucket, objects = source
    dest = tmp_path / "dl"
    for obj in src.list(f"s3://{bucket}/corpus"):
        src.download(obj, dest / obj.relpath)
    assert (dest / "sub" / "c.jsonl").read_bytes() == objects["corpus/sub/c.jsonl"]
    assert (dest / "a.jsonl").read_bytes() == objects["corpus/a.jsonl"]
    assert sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()) == [
        "a.jsonl",
        "b.jsonl",
        "sub/c.jsonl",
    ]  # no .part left behind


def test_object_source_downloads_a_multipart_object_by_its_size(source, tmp_path):
    import io

    src, bucket, _ = source
    data = bytes(range(256)) * (6 * 4096 + 3)  # just over 6 MiB: two parts of a multipart upload
    src.client.put_object(bucket, "big/blob.bin", io.BytesIO(data), -1, part_size=5 * 1024 * 1024)
    (obj,) = src.list(f"s3://{bucket}/big")
    assert "-" in obj.etag  # a multipart ETag is no MD5 of the bytes
    src.download(obj, tmp_path / "blob.bin")
    assert (tmp_path / "blob.bin").read_bytes() == data


@pytest.mark.parametrize(
    ("replacement", "why"),
    [(b'{"text": "BEE"}\n', "MD5 mismatch"), (b"other length\n", "downloaded 13 bytes, listed as 16")],
    ids=["same-size", "other-size"],
)
def test_object_source_download_of_changed_bytes_is_an_integrity_error(source, tmp_path, replacement, why):
    import io

    src, bucket, _ = source
    (obj,) = src.list(f"s3://{bucket}/corpus/b.jsonl")
    src.client.put_object(bucket, obj.key, io.BytesIO(replacement), len(replacement))  # changed since listed
    with pytest.raises(IntegrityError, match=f"s3://{bucket}/corpus/b.jsonl: {why}"):
        src.download(obj, tmp_path / "dl" / "b.jsonl")
    assert list((tmp_path / "dl").iterdir()) == []  # neither the file nor its .part


def test_object_source_needs_the_minio_backend(tmp_path):
    from components.store import StoreError, object_source
    from tests.conftest import store_config

    with pytest.raises(StoreError, match="s3:// sources need store.backend=minio"):
        object_source(store_config("local", tmp_path))


# -- damage: verify, quarantine, heal -------------------------------------------------------------


def test_verify_names_every_damaged_object(store, tmp_path):
    from tests.store_objects import is_s3

    m = store.publish("checkpoint", "m", "id-step10-aaa", make_tree(tmp_path / "src", "x"))
    assert store.verify(m.ref) == []
    store.backend.put_bytes("checkpoint/m/id-step10-aaa/sub/b.bin", b"y" * 1000)  # same size, other bytes
    store.backend.put_bytes("checkpoint/m/id-step10-aaa/a.txt", b"short")
    assert store.verify(m.ref) == [
        "checkpoint/m/id-step10-aaa/a.txt: 5 bytes, the manifest says 7",
        f"checkpoint/m/id-step10-aaa/sub/b.bin: sha256 {hashlib.sha256(b'y' * 1000).hexdigest()[:12]}, "
        f"the manifest says {m.files['sub/b.bin']['sha256'][:12]}",
    ]
    if is_s3(store):
        store.backend.client.remove_object(store.backend.bucket, "checkpoint/m/id-step10-aaa/a.txt")
    else:
        (store.backend.root / "checkpoint/m/id-step10-aaa/a.txt").unlink()
    assert store.verify(m.ref)[0] == "checkpoint/m/id-step10-aaa/a.txt: missing"


def test_a_quarantined_version_no_longer_exists_but_its_bytes_stay(store, tmp_path):
    from tests.store_objects import is_s3, object_versions

    store.publish("checkpoint", "m", "id-step10-aaa", make_tree(tmp_path / "old", "old"), metadata={"step": 10})
    time.sleep(0.01)
    bad = store.publish("checkpoint", "m", "id-step20-bbb", make_tree(tmp_path / "new", "new"), metadata={"step": 20})
    store.backend.put_bytes("checkpoint/m/id-step20-bbb/sub/b.bin", b"truncated")
    problems = store.check(bad.ref)
    assert problems == ["checkpoint/m/id-step20-bbb/sub/b.bin: 9 bytes, the manifest says 3000"]

    assert not store.exists(bad.ref)
    with pytest.raises(NotFound):
        store.manifest(bad.ref)
    with pytest.raises(NotFound, match="no version checkpoint/m@id-step20-bbb"):
        store.resolve("checkpoint", "m", "id-step20-bbb")
    assert [m.ref.version for m in store.versions("checkpoint", "m")] == ["id-step10-aaa"]
    assert store.resolve("checkpoint", "m").ref.version == "id-step10-aaa"  # never resumed from
    assert [str(m.ref) for m in store.ls()] == ["checkpoint/m@id-step10-aaa"]

    record = json.loads(store.backend.get_bytes("checkpoint/m/id-step20-bbb/manifest.quarantined.json"))
    assert record["reason"] == f"does not verify: {problems[0]}" and record["at"]
    assert record["manifest"]["files"] == bad.files and record["manifest"]["metadata"] == {"step": 20}
    assert store.quarantined(bad.ref) == record
    stored = dict(object_versions(store, "checkpoint/m/id-step20-bbb")) if not is_s3(store) else None
    if stored is not None:  # locally: the manifest is gone, the bytes and the record are there
        assert set(stored) == {
            "checkpoint/m/id-step20-bbb/a.txt",
            "checkpoint/m/id-step20-bbb/sub/b.bin",
            "checkpoint/m/id-step20-bbb/manifest.quarantined.json",
        }
    else:  # on S3 the manifest's last version is behind a delete marker, kept for forensics
        kinds = [w for k, w in object_versions(store, "checkpoint/m/id-step20-bbb/manifest.json")]
        assert kinds == ["delete-marker", "noncurrent"]
    assert store.backend.get_bytes("checkpoint/m/id-step20-bbb/a.txt") == b"alpha new"
    assert store.quarantine(bad.ref, "again") == record  # idempotent: the first reason stays
    with pytest.raises(NotFound, match="to quarantine"):
        store.quarantine(Ref("checkpoint", "m", "never-stored"), "x")


def test_committing_a_quarantined_version_again_makes_it_valid(store, tmp_path):
    src = make_tree(tmp_path / "src", "w")
    m = store.publish("checkpoint", "m", "id-step20-bbb", src, metadata={"step": 20})
    store.backend.put_bytes("checkpoint/m/id-step20-bbb/sub/b.bin", b"w" * 999 + b"!")  # bit rot, same size
    store.check(m.ref)
    assert not store.exists(m.ref)
    # a rerun that retrains identical weights produces the same content-named version
    again = store.publish("checkpoint", "m", "id-step20-bbb", src, metadata={"step": 20}, same_content=True)
    assert store.exists(m.ref) and again.files == m.files and store.verify(m.ref) == []
    assert store.quarantined(m.ref) is None
    with pytest.raises(NotFound):
        store.backend.get_bytes("checkpoint/m/id-step20-bbb/manifest.quarantined.json")
    assert (store.fetch(again, tmp_path / "out") / "sub" / "b.bin").read_bytes() == b"w" * 1000


def test_a_commit_that_does_not_replace_the_damaged_bytes_stays_quarantined(store, tmp_path):
    m = store.publish("checkpoint", "m", "v", make_tree(tmp_path / "src", "w"))
    store.backend.put_bytes("checkpoint/m/v/sub/b.bin", b"w" * 999 + b"!")
    store.check(m.ref)
    with pytest.raises(IntegrityError, match="checkpoint/m@v stays quarantined: .*sub/b.bin: sha256"):
        store.commit(m.ref, m.files)  # the manifest's entries, without uploading the good bytes
    assert not store.exists(m.ref) and store.quarantined(m.ref) is not None


def test_lineage_shows_a_quarantined_parent_and_no_new_version_is_made_from_it(store, tmp_path):
    store.publish("dataset", "d", "h1", make_tree(tmp_path / "d", "d"))
    ck = store.publish("checkpoint", "c", "r-step5", make_tree(tmp_path / "c", "c"), parents=["dataset/d@h1"])
    store.publish("model", "m", "r", make_tree(tmp_path / "m", "m"), parents=["checkpoint/c@r-step5"])
    store.backend.put_bytes("checkpoint/c/r-step5/a.txt", b"rotten!")
    store.check(ck.ref)
    tree = store.lineage(Ref("model", "m", "r"))
    parent = tree["parents"][0]
    assert parent["ref"] == "checkpoint/c@r-step5" and parent["quarantined"] is True
    assert parent["reason"].startswith("does not verify: checkpoint/c/r-step5/a.txt: sha256")
    assert parent["parents"][0]["ref"] == "dataset/d@h1"  # its own lineage is still shown
    bad = store.verify_lineage(Ref("model", "m", "r"))
    assert list(bad) == ["checkpoint/c@r-step5"] and bad["checkpoint/c@r-step5"][0].startswith("quarantined: ")
    with pytest.raises(IntegrityError, match="parent checkpoint/c@r-step5 is quarantined"):
        store.publish("model", "m", "r2", make_tree(tmp_path / "m2", "m2"), parents=["checkpoint/c@r-step5"])
    assert not store.exists(Ref("model", "m", "r2"))


# -- deleting and pinning --------------------------------------------------------------------------


def test_delete_removes_every_object_and_every_object_version(store, tmp_path):
    from tests.store_objects import is_s3, keys_under

    store.publish("dataset", "d", "v1", make_tree(tmp_path / "a", "a"))
    store.publish("dataset", "d", "v10", make_tree(tmp_path / "b", "b"))
    store.backend.put_bytes("dataset/d/v1/a.txt", b"overwritten: an older object version stays on S3")
    store.pin(Ref("dataset", "d", "v1"))
    assert keys_under(store, "dataset/d/v1")
    store.delete(Ref("dataset", "d", "v1"))
    assert keys_under(store, "dataset/d/v1") == []  # nothing, not even a noncurrent version or marker
    assert keys_under(store, "dataset/d/v10") == sorted(
        ["dataset/d/v10/a.txt", "dataset/d/v10/manifest.json", "dataset/d/v10/sub/b.bin"]
    )
    assert [m.ref.version for m in store.versions("dataset", "d")] == ["v10"]
    with pytest.raises(NotFound, match="no version dataset/d@v1"):
        store.delete(Ref("dataset", "d", "v1"))
    if is_s3(store):
        assert store.backend.purge("dataset/d/v10") == 3


def test_delete_takes_the_manifest_first(store, tmp_path):
    store.publish("dataset", "d", "v", make_tree(tmp_path / "a", "a"))
    real, order = store.backend, []

    class Recording:
        description = real.description

        def purge(self, prefix):
            order.append(prefix)
            if len(order) == 2:
                raise ConnectionError("cut after the manifest")
            return real.purge(prefix)

        def __getattr__(self, name):
            return getattr(real, name)

    store.backend = Recording()
    with pytest.raises(ConnectionError):
        store.delete(Ref("dataset", "d", "v"))
    store.backend = real
    assert order == ["dataset/d/v/manifest.json", "dataset/d/v"]
    assert not store.exists(Ref("dataset", "d", "v")) and store.versions("dataset", "d") == []  # invisible


def test_pins_are_objects_of_the_version(store, tmp_path):
    m = store.publish("checkpoint", "m", "v", make_tree(tmp_path / "a", "a"))
    assert not store.is_pinned(m.ref)
    store.pin(m.ref)
    assert store.is_pinned(m.ref) and json.loads(store.backend.get_bytes("checkpoint/m/v/manifest.pinned.json"))
    assert store.verify(m.ref) == [] and store.versions("checkpoint", "m")[0].files == m.files
    store.unpin(m.ref)
    assert not store.is_pinned(m.ref)
    with pytest.raises(NotFound, match="to pin"):
        store.pin(Ref("checkpoint", "m", "absent"))


@pytest.mark.parametrize("name", ["manifest.pinned.json", "manifest.quarantined.json", "manifest.json"])
def test_the_store_s_own_file_names_cannot_be_published(store, tmp_path, name):
    src = make_tree(tmp_path / "src", "x")
    (src / name).write_text("{}")
    with pytest.raises(InvalidKey, match=f"contains a file named {name}, which the store reserves"):
        store.publish("dataset", "d", "v", src)


# -- a store that is not there, or cannot be written ------------------------------------------------


def test_reading_a_store_that_does_not_exist_names_store_root(tmp_path):
    from components.store import StoreError

    missing = tmp_path / "no-store-here"
    with pytest.raises(StoreError) as e:
        open_store(defaults("store", root=str(missing), cache_dir=str(tmp_path / "c")), create=False)
    assert str(e.value) == f"store.root={missing}: no artifact store there"
    assert not missing.exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(StoreError) as e:
        open_store(defaults("store", root=str(tmp_path / "file"), cache_dir=str(tmp_path / "c")), create=False)
    assert str(e.value) == f"store.root={tmp_path / 'file'}: no artifact store there (not a directory)"


def test_reading_a_bucket_that_does_not_exist_names_store_bucket(s3_env, tmp_path):
    from components.store import StoreError
    from tests.conftest import store_config

    cfg = store_config("minio", tmp_path)
    with pytest.raises(StoreError) as e:
        open_store(cfg, create=False)
    assert str(e.value) == f"store.bucket={cfg.bucket}: no artifact store there (MinIO endpoint {s3_env})"
    assert not open_store(store_config("minio", tmp_path)).backend.client.bucket_exists(cfg.bucket)


def test_writing_where_no_store_can_be_names_store_root_the_path_and_the_reason(tmp_path):
    from components.store import StoreError

    store = open_store(defaults("store", root="/proc/x", cache_dir=str(tmp_path / "c")))
    with pytest.raises(StoreError) as e:
        store.publish("dataset", "d", "v", make_tree(tmp_path / "src", "x"))
    assert str(e.value) == "store.root=/proc/x: cannot write dataset/d/v/a.txt there: No such file or directory"
    (tmp_path / "file").write_text("x")
    with pytest.raises(StoreError) as e:
        open_store(defaults("store", root=str(tmp_path / "file" / "store"), cache_dir=str(tmp_path / "c")))
    root, above = tmp_path / "file" / "store", tmp_path / "file"
    assert str(e.value) == f"store.root={root}: cannot create the artifact store there: {above} is a file"
    with pytest.raises(StoreError) as e:
        open_store(defaults("store", root=str(tmp_path / "file"), cache_dir=str(tmp_path / "c")))
    assert str(e.value) == f"store.root={tmp_path / 'file'}: cannot use it as the artifact store: Not a directory"
