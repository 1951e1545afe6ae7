"""Checkpoint retention on both backends, asserted on what the store holds afterwards (on S3
every object version and delete marker, from boto3's list_object_versions)."""

from __future__ import annotations

from pathlib import Path

import pytest

from components.store import Ref, apply_retention, plan_retention
from tests.store_objects import is_s3, keys_under, object_versions

IDENT = "3f2a9c0d11aa"
OTHER = "77bb00cc22dd"


def checkpoint(store, tmp: Path, identity: str, step: int, parents=(), model: str = "tiny") -> Ref:
    """A checkpoint version as the trainer names it: `<identity>-step<N>-<digest>`, metadata
    identity and step, two rank files and an index."""
    src = tmp / f"src-{identity}-{step}"
    src.mkdir(parents=True)
    for rank in (0, 1):
        (src / f"__{rank}_0.distcp").write_bytes(f"{identity}:{step}:{rank}".encode() * 100)
    (src / "checkpoint.json").write_text(f'{{"step": {step}}}')
    version = f"{identity}-step{step}-{step:012x}"
    store.publish("checkpoint", model, version, src, metadata={"identity": identity, "step": step}, parents=parents)
    return Ref("checkpoint", model, version)


def leaf(store, tmp: Path, kind: str, name: str, version: str, parents) -> Ref:
    src = tmp / f"{kind}-{name}-{version}"
    src.mkdir(parents=True)
    (src / "out.bin").write_bytes(version.encode())
    store.publish(kind, name, version, src, parents=list(parents))
    return Ref(kind, name, version)


def stored(store, ref: Ref) -> list[str]:
    return keys_under(store, ref.prefix)


def test_retention_keeps_the_newest_the_lineage_and_the_pinned(store, tmp_path):
    data = leaf(store, tmp_path, "dataset", "kjv", "h1", [])
    ours = {s: checkpoint(store, tmp_path, IDENT, s, [str(data)]) for s in (10, 20, 30, 40, 50, 60)}
    theirs = {s: checkpoint(store, tmp_path, OTHER, s, [str(data)]) for s in (10, 20, 30)}
    model = leaf(store, tmp_path, "model", "tiny", "r1", [str(data), str(ours[20])])
    leaf(store, tmp_path, "eval", "tiny", "e1", [str(model)])
    store.pin(ours[30])
    # an overwrite: on S3 the first bytes stay as a noncurrent version, which retention removes too
    store.backend.put_bytes(f"{ours[10].prefix}/__0_0.distcp", b"rewritten")
    if is_s3(store):
        assert ("checkpoint/tiny/" + ours[10].version + "/__0_0.distcp", "noncurrent") in object_versions(
            store, ours[10].prefix
        )

    deleted = apply_retention(store, "tiny", IDENT, keep=2)

    assert deleted == [ours[40], ours[10]]  # newest first
    for s in (40, 10):
        assert stored(store, ours[s]) == []  # no object, no object version, no delete marker
    for s in (60, 50, 30, 20):  # newest 2, pinned, named by the model's lineage
        assert f"{ours[s].prefix}/manifest.json" in stored(store, ours[s]) and store.verify(ours[s]) == []
    for ref in theirs.values():  # another identity: untouched
        assert store.exists(ref)
    assert [m.ref for m in store.versions("checkpoint", "tiny") if m.metadata["identity"] == IDENT] == [
        ours[20],
        ours[30],
        ours[50],
        ours[60],
    ]
    assert store.verify_lineage(model) == {}  # a version some lineage names is never deleted
    assert apply_retention(store, "tiny", IDENT, keep=2) == []  # nothing more to do


def test_lineage_is_followed_however_far_and_from_runs_and_other_identities(store, tmp_path):
    ours = {s: checkpoint(store, tmp_path, IDENT, s) for s in (10, 20, 30, 40, 50)}
    # a longer run continued from step 20 (train.resume=<version>): its checkpoints name it
    continued = checkpoint(store, tmp_path, OTHER, 60, [str(ours[20])])
    # a run record naming a model naming step 10: reached two hops away
    model = leaf(store, tmp_path, "model", "tiny", "r1", [str(ours[10])])
    leaf(store, tmp_path, "run", IDENT, "launch-1", [str(model)])
    kept, delete = plan_retention(store, "tiny", IDENT, keep=1)
    assert kept == [ours[50], ours[20], ours[10]] and delete == [ours[40], ours[30]]
    assert apply_retention(store, "tiny", IDENT, keep=1) == [ours[40], ours[30]]
    assert store.exists(ours[10]) and store.exists(ours[20]) and store.exists(continued)
    assert stored(store, ours[40]) == [] and stored(store, ours[30]) == []
    assert store.verify_lineage(Ref("run", IDENT, "launch-1")) == {}
    assert store.verify_lineage(continued) == {}


def test_quarantined_versions_are_left_for_artifacts_rm(store, tmp_path):
    ours = {s: checkpoint(store, tmp_path, IDENT, s) for s in (10, 20, 30)}
    store.backend.put_bytes(f"{ours[10].prefix}/__1_0.distcp", b"rot")
    store.check(ours[10])
    assert apply_retention(store, "tiny", IDENT, keep=1) == [ours[20]]
    assert store.quarantined(ours[10]) is not None and f"{ours[10].prefix}/__1_0.distcp" in stored(store, ours[10])


def test_versions_without_identity_metadata_are_read_from_their_name(store, tmp_path):
    for step in (1, 2, 3):
        src = tmp_path / f"s{step}"
        src.mkdir()
        (src / "x").write_text(str(step))
        store.publish("checkpoint", "tiny", f"{IDENT}-step{step}-abcdef012345", src)
    deleted = apply_retention(store, "tiny", IDENT, keep=1)
    assert [r.version for r in deleted] == [f"{IDENT}-step2-abcdef012345", f"{IDENT}-step1-abcdef012345"]
    assert [m.ref.version for m in store.versions("checkpoint", "tiny")] == [f"{IDENT}-step3-abcdef012345"]


@pytest.mark.parametrize("keep", [0, -1, 1.5, True])
def test_retention_keeps_at_least_one(store, keep):
    with pytest.raises(ValueError, match="keep at least the newest checkpoint"):
        apply_retention(store, "tiny", IDENT, keep=keep)


def test_a_quarantined_versions_parents_are_still_kept(store, tmp_path):
    """model -> checkpoint B (a run continued from A, since quarantined) -> seed checkpoint A:
    B's manifest is gone from the store's view, but its lineage still counts, so A survives."""
    ours = {s: checkpoint(store, tmp_path, IDENT, s) for s in (10, 20, 30)}
    seed = ours[10]
    b = checkpoint(store, tmp_path, OTHER, 40, [str(seed)])
    model = leaf(store, tmp_path, "model", "tiny", "r1", [str(b)])
    store.quarantine(b, "does not verify: test")
    assert not store.exists(b) and store.quarantined(b) is not None

    deleted = apply_retention(store, "tiny", IDENT, keep=1)

    assert store.exists(seed) and store.verify(seed) == []  # the seed, reached only through B
    assert f"{seed.prefix}/manifest.json" in stored(store, seed)
    assert deleted == [ours[20]] and stored(store, ours[20]) == []  # retention ran: the unnamed older step went
    assert store.exists(model) and store.quarantined(b) is not None
