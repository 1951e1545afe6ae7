"""The streaming reader: shards fetched from the store into a bounded node cache, on both backends."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import numpy as np
import pytest
import torch

from components.blocks import BlockWriter
from components.config import defaults
from components.store import IntegrityError, Ref, open_store
from components.stream import DatasetLayoutError, StreamingBlocks, open_split
from components.tokenize.merge import merge_shards
from components.tokenize.plan import Plan
from components.train.data import BlockSampler

BLOCK_LEN = 2049


def block_values(shard: int, j: int) -> np.ndarray:
    """The content of block j of shard s: distinct for every (s, j), so a wrong read shows."""
    return ((np.arange(BLOCK_LEN, dtype=np.int64) * 7 + shard * 100_003 + j * 31) % 65_000).astype(np.uint16)


def synthetic_dataset(store, tmp: Path, shards: int, blocks: int, name: str = "syn"):
    """A dataset version of `shards` shards of `blocks` train blocks (and 1 val block) each,
    published and merged as the tokenize stage does, without tokenizing anything."""
    plan = Plan(Ref("dataset", name, f"v{shards}x{blocks}"), [[] for _ in range(shards)], 65_000, 0, "uint16")
    (tmp / "tok" / "tokenizer").mkdir(parents=True)
    (tmp / "tok" / "tokenizer" / "tokenizer.json").write_text("{}")
    (tmp / "tok" / "plan.json").write_text(plan.to_json())
    store.publish("tokenizer", name, plan.dataset.version, tmp / "tok")
    refs = []
    for s in range(shards):
        out = tmp / f"shard{s}"
        out.mkdir()
        splits = {}
        for split, n in (("train", blocks), ("val", 1)):
            w = BlockWriter(out / f"{split}.arrow", BLOCK_LEN, np.dtype(np.uint16))
            for start in range(0, n, 256):
                w(np.stack([block_values(s, j) for j in range(start, min(n, start + 256))]))
            w.close()
            size = (out / f"{split}.arrow").stat().st_size
            splits[split] = {"documents": n, "tokens": n * BLOCK_LEN, "blocks": n, "bytes": size}
        stats = {"documents_in": blocks + 1, "dropped": {}, "splits": splits, "tokens_per_second": 1.0, "seconds": 1.0}
        ref = plan.shard_ref(s)
        refs.append(str(store.publish(ref.kind, ref.name, ref.version, out, metadata={"stats": stats}).ref))
    data = defaults("data", name=name, paths=["unused"], seq_len=BLOCK_LEN - 1)
    manifest, _ = merge_shards(plan, refs, data, defaults("tokenizer"), store)
    return manifest


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_a_rank_over_a_dataset_8x_its_cache_keeps_disk_and_memory_bounded(tmp_path):
    store = open_store(defaults("store", root=str(tmp_path / "store"), cache_dir=str(tmp_path / "cache")))
    manifest = synthetic_dataset(store, tmp_path, shards=16, blocks=1024)  # 16 x 4 MiB
    shard_bytes = max(s["splits"]["train"]["bytes"] for s in manifest.metadata["shards"])
    total = sum(s["splits"]["train"]["bytes"] for s in manifest.metadata["shards"])
    cache_gb = total / 8 / 2**30
    blocks = open_split(store, manifest, "train", cache_gb)
    sampler = BlockSampler(blocks, micro_batch=8, grad_accum=1, world=1, rank=0, seed=0)
    n_batches = len(blocks) // 8
    disk, rss, seen = [], {}, set()
    for b in range(n_batches):
        rows = sampler.batch(b * 8, torch.device("cpu"))
        for (s, j), row in zip(sampler.indices(b * 8), rows.numpy(), strict=True):
            np.testing.assert_array_equal(row, block_values(s, j))  # the right bytes, shard by shard
            seen.add((s, j))
        disk.append(blocks.disk_bytes())
        if b in (n_batches // 8, n_batches - 1):
            rss[b] = rss_bytes()
    blocks.close()
    assert len(seen) == len(blocks) == 16 * 1024  # one epoch: every block once
    assert blocks.fetches >= 16  # every shard came from the store, none was there before
    assert blocks.fetched_ahead >= 15  # all but the first were fetched before the reader reached them
    assert max(disk) <= cache_gb * 2**30 + shard_bytes  # the bound: the cache plus one shard
    growth = rss[n_batches - 1] - rss[n_batches // 8]
    assert growth < 3 * shard_bytes, f"RSS grew {growth / 2**20:.1f} MiB over 7/8 of a {total / 2**20:.0f} MiB epoch"


def test_streamed_blocks_over_both_backends_equal_the_shard_files(store, tmp_path):
    manifest = synthetic_dataset(store, tmp_path, shards=3, blocks=40)
    blocks = open_split(store, manifest, "train", cache_gb=1e-9)  # below one shard: every new shard evicts
    assert blocks.sizes == [40, 40, 40] and len(blocks) == 120
    for i in np.random.default_rng(0).permutation(120):
        np.testing.assert_array_equal(blocks[int(i)], block_values(int(i) // 40, int(i) % 40))
    assert len(list(blocks.cache_dir.glob("*.arrow"))) <= 2  # the one read and the one prefetched
    blocks.close()


def test_a_corrupted_shard_object_is_refused_and_a_damaged_cache_file_is_fetched_again(tmp_path):
    store = open_store(defaults("store", root=str(tmp_path / "store"), cache_dir=str(tmp_path / "cache")))
    manifest = synthetic_dataset(store, tmp_path, shards=2, blocks=8)
    blocks = open_split(store, manifest, "train")
    np.testing.assert_array_equal(blocks.block(0, 3), block_values(0, 3))
    cached = blocks._path(0)
    blocks.close()
    cached.write_bytes(cached.read_bytes()[:-100])  # a truncated cache file (a crash mid-write elsewhere)
    again = open_split(store, manifest, "train")
    np.testing.assert_array_equal(again.block(0, 3), block_values(0, 3))
    assert again.fetches == 1
    again.close()
    obj = tmp_path / "store" / Ref.parse(manifest.metadata["shards"][1]["ref"]).prefix / "train.arrow"
    data = bytearray(obj.read_bytes())
    data[-10] ^= 0xFF
    obj.write_bytes(bytes(data))
    fresh = StreamingBlocks(store, manifest, "train", tmp_path / "other-cache", 1 << 30)
    with pytest.raises(IntegrityError, match="sha256 mismatch"):
        fresh.block(1, 0)
    fresh.close()


def _first_block(args) -> tuple[int, list[int]]:
    root, cache = args
    store = open_store(defaults("store", root=root, cache_dir=cache))
    manifest = store.manifest(Ref("dataset", "syn", "v2x64"))
    blocks = open_split(store, manifest, "train", 1.0)
    row = blocks.block(1, 5)[:4].tolist()
    blocks.close()
    return blocks.fetches, row


def test_the_ranks_of_a_node_share_its_cache_and_fetch_a_shard_once(tmp_path):
    store = open_store(defaults("store", root=str(tmp_path / "store"), cache_dir=str(tmp_path / "cache")))
    synthetic_dataset(store, tmp_path, shards=2, blocks=64)
    args = (str(tmp_path / "store"), str(tmp_path / "node-cache"))
    with mp.get_context("spawn").Pool(2) as pool:
        results = pool.map(_first_block, [args, args])
    assert [r for _, r in results] == [block_values(1, 5)[:4].tolist()] * 2
    assert sum(f for f, _ in results) == 1  # one process fetched; the other found it under the lock


def test_a_dataset_without_a_shard_list_is_refused_naming_the_fix(tmp_path):
    store = open_store(defaults("store", root=str(tmp_path / "store"), cache_dir=str(tmp_path / "cache")))
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "stats.json").write_text("{}")
    old = store.publish("dataset", "old", "v1", tmp_path / "old", metadata={"stats": {"vocab_size": 10}})
    with pytest.raises(DatasetLayoutError, match="lists no shards .* run tokenize again"):
        open_split(store, old, "train")
