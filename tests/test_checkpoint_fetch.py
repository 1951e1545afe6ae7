"""Fetching part of a stored checkpoint (components/checkpoint_fetch.py), on real bytes in a
store: only the blocks a load reads land on the node, each verified, in a sparse file."""

from __future__ import annotations

import json
import os

import pytest

from components import checkpoint_format as ckpt
from components.checkpoint_fetch import WHOLE, fetch_head, fetch_reads, merge
from components.store import IntegrityError, Ref

BLOCK = 4096
SHARD = "__0_0.distcp"


@pytest.fixture
def stored(store, tmp_path):
    """A stored checkpoint version (on both backends): a 10.5-block shard file of random bytes
    indexed with per-block digests, a rank file, meta.json and the index."""
    src = tmp_path / "src"
    src.mkdir()
    data = os.urandom(10 * BLOCK + BLOCK // 2)
    (src / SHARD).write_bytes(data)
    (src / "rank0.pt").write_bytes(b"rng state")
    (src / "meta.json").write_text(json.dumps({"step": 3}))
    entries = ckpt.file_entries(src, [SHARD, "rank0.pt", "meta.json"], BLOCK)
    ckpt.write_index(src, ckpt.index_bytes(entries, {"step": 3}))
    manifest = store.publish("checkpoint", "tiny", "v-step3", src, metadata={"step": 3})
    return manifest, data


def blocks_on_disk(path) -> int:
    return path.stat().st_blocks * 512


def test_only_the_blocks_read_are_fetched_verified_into_a_sparse_file(store, stored, tmp_path):
    manifest, data = stored
    head = fetch_head(store, tmp_path / "node", manifest)
    assert sorted(p.name for p in head.iterdir()) == ["checkpoint.json", "meta.json"]
    # two ranks of one node: one reads a span inside block 1, the other across blocks 3-4 and the tail
    reads = merge([{SHARD: [(BLOCK + 10, 100)]}, {SHARD: [(4 * BLOCK - 5, 10), (10 * BLOCK, BLOCK // 2)]}])
    fetched = fetch_reads(store, manifest, head, reads)
    shard = head / SHARD
    assert fetched == 3 * BLOCK + BLOCK // 2  # blocks 1, 3, 4 and the short last one
    assert shard.stat().st_size == len(data) and blocks_on_disk(shard) <= 5 * BLOCK
    got = shard.read_bytes()
    for b in (1, 3, 4, 10):
        assert got[b * BLOCK : (b + 1) * BLOCK] == data[b * BLOCK : (b + 1) * BLOCK]
    assert got[2 * BLOCK : 3 * BLOCK] == bytes(BLOCK)  # never fetched: a hole
    assert not (head / "rank0.pt").exists()
    # again: every block it needs is here and verifies, nothing is fetched
    assert fetch_reads(store, manifest, head, reads) == 0
    # a rank's own file is read whole, verified whole
    assert fetch_reads(store, manifest, head, {"rank0.pt": WHOLE}) == len(b"rng state")


def test_a_stale_local_copy_is_healed_block_by_block(store, stored, tmp_path):
    """A node's copy from a killed fetch: the wrong size and a garbage block. The blocks a load
    reads are checked and refetched; the file takes the stored size."""
    manifest, data = stored
    head = fetch_head(store, tmp_path / "node", manifest)
    (head / SHARD).write_bytes(data[:BLOCK] + b"x" * BLOCK)  # block 0 right, block 1 garbage, short
    assert fetch_reads(store, manifest, head, {SHARD: [(0, 2 * BLOCK)]}) == BLOCK  # block 1 only
    got = (head / SHARD).read_bytes()
    assert len(got) == len(data) and got[: 2 * BLOCK] == data[: 2 * BLOCK]


def test_a_stored_block_with_other_bytes_of_the_same_size_is_damage_named_by_its_block(store, stored, tmp_path):
    manifest, data = stored
    key = f"{manifest.ref.prefix}/{SHARD}"
    bad = bytearray(data)
    bad[7 * BLOCK + 3] ^= 0xFF
    store.backend.put_bytes(key, bytes(bad))
    head = fetch_head(store, tmp_path / "node", store.manifest(Ref("checkpoint", "tiny", "v-step3")))
    assert fetch_reads(store, manifest, head, {SHARD: [(0, BLOCK)]}) == BLOCK  # block 0 is sound
    with pytest.raises(IntegrityError, match=rf"{SHARD} block 7 \(bytes {7 * BLOCK}-{8 * BLOCK}\)"):
        fetch_reads(store, manifest, head, {SHARD: [(7 * BLOCK, 10)]})
    assert (head / SHARD).read_bytes()[7 * BLOCK : 8 * BLOCK] == bytes(BLOCK)  # nothing unverified was kept


@pytest.mark.parametrize(
    "reads, why",
    [
        ({SHARD: [(10 * BLOCK, BLOCK)]}, "outside its"),  # past the end of the file
        ({SHARD: [(-1, 10)]}, "outside its"),
        ({"__9_0.distcp": [(0, 10)]}, "does not list"),
    ],
)
def test_reads_the_index_cannot_serve_are_refused_before_any_byte_is_fetched(store, stored, tmp_path, reads, why):
    manifest, _ = stored
    head = fetch_head(store, tmp_path / "node", manifest)
    with pytest.raises(ckpt.CheckpointError, match=why):
        fetch_reads(store, manifest, head, reads)
    assert not (head / SHARD).exists()
