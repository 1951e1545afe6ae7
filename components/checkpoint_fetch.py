"""Fetching from the store only the part of a checkpoint that a node's ranks load.

A stored checkpoint is every rank's DCP shard files; a resuming rank reads only the items its
own state (its FSDP shards, its pipeline stage, its TP slices) needs, wherever they lie. So:
1. the head (`checkpoint.json`, `meta.json`, DCP's `.metadata`, the history) comes first,
   checked against the version's manifest: the index it holds must list exactly the manifest's
   files with the same digests, so what the index says of blocks is the store's word;
2. every rank plans its load against `.metadata` (`read_ranges`: the byte ranges of each file
   that its ReadItems name, DCP's own planner deciding);
3. each node's first rank fetches the union of its ranks' ranges, rounded out to the blocks
   whose sha256 the index records (`fetch_reads`), verifies every block and writes it at its
   offset in a sparse file of the right size. A file whose blocks are all read, or one written
   before blocks were recorded, is fetched whole against its sha256.
A block already on the node that verifies is kept. Bytes a node's ranks never read are never
fetched; the unfetched holes are never read (DCP reads exactly the planned items).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from components.checkpoint_format import (
    HISTORY,
    INDEX,
    MODEL_KEY,
    CheckpointError,
    SafeLoadPlanner,
    read_metadata_safely,
)
from components.store import ArtifactStore, IntegrityError, Manifest, Ref, StoreError, check_relpath, sha256_file

log = logging.getLogger(__name__)

META = "meta.json"
DCP_METADATA = ".metadata"
HEAD = (INDEX, META, DCP_METADATA, HISTORY)
WHOLE = None  # a read of a whole file (a rank's RNG state)
RANGE_BYTES = 64 << 20  # the most one range request asks for (consecutive blocks)

Ranges = dict[str, list[tuple[int, int]] | None]  # file -> (offset, length) read, or WHOLE


def step_of_manifest(manifest: Manifest) -> int | None:
    step = manifest.metadata.get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None


def fetch_head(store: ArtifactStore, root: Path, manifest: Manifest) -> Path:
    """`root/step-N` holding the stored version's head, verified: its index is the manifest's
    (every file, digest and size), its DCP metadata unpickles with the allowlist. A directory
    there of another version is replaced; files the version does not have are removed (another
    world size's rank files: DCP must see the stored version only)."""
    step = step_of_manifest(manifest)
    if step is None:  # it names a directory here
        bad = manifest.metadata.get("step")
        raise CheckpointError(f"{manifest.ref}: its manifest's step {bad!r} is not a step number")
    dest = root / f"step-{step}"
    index = dest / INDEX
    stored_index = manifest.files.get(INDEX, {}).get("sha256")
    if stored_index is None:
        raise CheckpointError(f"{manifest.ref}: no {INDEX} among its files")
    if dest.exists() and (not index.is_file() or sha256_file(index) != stored_index):
        log.info("%s on this node is not %s of %s: replacing it", dest.name, manifest.ref, store.description)
        shutil.rmtree(dest)
    for rel in manifest.files:
        check_relpath(rel)
    for extra in (p for p in dest.glob("*") if p.is_file() and p.name not in manifest.files):
        if not extra.name.startswith(".liftoff"):
            extra.unlink()
    for name in HEAD:
        if name in manifest.files:
            store.fetch_file(manifest, name, dest / name)
    files = index_files(dest)
    listed = {**{n: (e["sha256"], e["size"]) for n, e in files.items()}, INDEX: None}
    stored = {**{n: (e["sha256"], e["size"]) for n, e in manifest.files.items()}, INDEX: None}
    if listed != stored:
        differ = sorted(set(listed.items()) ^ set(stored.items()))
        raise CheckpointError(f"{manifest.ref}: its index and its manifest disagree on {differ[0][0]}")
    if (dest / DCP_METADATA).is_file():
        read_metadata_safely(dest / DCP_METADATA)
    return dest


def index_files(ckpt: Path) -> dict[str, dict]:
    try:
        return json.loads((ckpt / INDEX).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{ckpt / INDEX}: unreadable ({e})") from None


def read_ranges(state: dict, ckpt: Path, rank: int | None = None) -> Ranges:
    """The byte ranges of each shard file that loading `state` from the checkpoint reads (DCP's
    own load planner against the stored metadata), and a training rank's RNG state whole."""
    metadata = read_metadata_safely(ckpt / DCP_METADATA)
    planner = SafeLoadPlanner()
    planner.set_up_planner(state, metadata, is_coordinator=False)
    ranges: Ranges = {}
    for item in planner.create_local_plan().items:
        info = metadata.storage_data[item.storage_index]
        ranges.setdefault(info.relative_path, []).append((info.offset, info.length))
    if rank is not None:
        ranges[f"rank{rank}.pt"] = WHOLE
    return ranges


def fetch_weights(store: ArtifactStore, manifest: Manifest, root: Path, weights: dict) -> tuple[Path, Ranges]:
    """A stored checkpoint's model weights on this machine, never its optimizer state: the head,
    then the parts of the model's shard files that loading `weights` (a state dict of the
    model's shapes) reads, verified. Where they landed and what was read."""
    path = fetch_head(store, root, manifest)
    reads = read_ranges({MODEL_KEY: weights}, path)
    fetch_reads(store, manifest, path, reads)
    return path, reads


def merge(parts: list[Ranges]) -> Ranges:
    """The reads of several ranks (one node's): a file read whole by any is read whole."""
    merged: Ranges = {}
    for part in parts:
        for name, spans in part.items():
            if name in merged and merged[name] is WHOLE:
                continue
            merged[name] = WHOLE if spans is WHOLE else [*(merged.get(name) or []), *spans]
    return merged


def blocks_read(spans: list[tuple[int, int]], block_bytes: int) -> list[int]:
    return sorted({b for off, n in spans if n > 0 for b in range(off // block_bytes, (off + n - 1) // block_bytes + 1)})


def fetch_reads(store: ArtifactStore, manifest: Manifest, ckpt: Path, reads: Ranges) -> int:
    """Fetch into `ckpt` what `reads` names that is not already there and verified; returns the
    bytes fetched. IntegrityError when a block or file does not match the index; CheckpointError
    when the reads or the index make no sense (a file it does not list, a span outside a file)."""
    files, fetched = index_files(ckpt), 0
    for name, spans in sorted(reads.items(), key=lambda kv: kv[0]):
        if name in HEAD:
            continue  # fetched and verified first
        entry = files.get(name)
        if entry is None:
            if spans is WHOLE and name.startswith("rank"):
                continue  # the RNG state of a rank the saving run did not have: the rank starts fresh
            raise CheckpointError(f"{ckpt / INDEX}: the load reads {name}, which the index does not list")
        blocks = _checked_blocks(ckpt, name, entry, spans)
        need = None if spans is WHOLE or blocks is None else blocks_read(spans, entry["block_bytes"])
        if need is None or len(need) == len(blocks):
            fetched += _whole(store, manifest, ckpt / name, name, entry)
        else:
            fetched += _blocks(store, manifest, ckpt / name, name, entry, need)
    return fetched


def _checked_blocks(ckpt: Path, name: str, entry: dict, spans) -> list[str] | None:
    """The file's block digests (None: recorded without them), once the index's block size and
    count fit the file's size and every span read lies inside the file."""
    size = entry["size"]
    if spans is not WHOLE and any(off < 0 or n < 0 or off + n > size for off, n in spans):
        raise CheckpointError(f"{ckpt / INDEX}: DCP's metadata reads {name} outside its {size} bytes")
    if "blocks" not in entry:
        return None
    block, blocks = entry.get("block_bytes"), entry["blocks"]
    if not isinstance(block, int) or block <= 0 or not isinstance(blocks, list) or len(blocks) != -(-size // block):
        raise CheckpointError(f"{ckpt / INDEX}: {name}: {len(blocks)} blocks of {block!r} bytes for {size} bytes")
    return blocks


def _whole(store: ArtifactStore, manifest: Manifest, target: Path, name: str, entry: dict) -> int:
    if target.is_file() and target.stat().st_size == entry["size"] and sha256_file(target) == entry["sha256"]:
        return 0
    store.fetch_file(manifest, name, target)
    return entry["size"]


def _blocks(store: ArtifactStore, manifest: Manifest, target: Path, name: str, entry: dict, need: list[int]) -> int:
    """The needed blocks at their offsets in a sparse file of the stored size, each verified
    before it is written; consecutive blocks in one request of at most RANGE_BYTES (or one
    block), so memory holds one request whatever the file's size."""
    size, block, digests = entry["size"], entry["block_bytes"], entry["blocks"]
    fd = os.open(target, os.O_RDWR | os.O_CREAT, 0o644)
    fetched = 0
    try:
        if os.fstat(fd).st_size != size:
            os.ftruncate(fd, size)
        # what is already here and verifies stays (a resume on the same node, the last try's copy)
        missing = [b for b in need if not _block_ok(os.pread(fd, block, b * block), digests[b])]
        for first, count in _runs(missing, max(1, RANGE_BYTES // block)):
            try:
                data = store.read_range(manifest, name, first * block, count * block)
            except IntegrityError as e:  # fewer bytes than the listing promised: the store, not the data
                raise StoreError(str(e)) from None
            for b in range(first, first + count):
                piece = data[(b - first) * block : (b - first + 1) * block]
                if not _block_ok(piece, digests[b]):
                    raise IntegrityError(
                        f"sha256 mismatch for {manifest.ref.prefix}/{name} block {b} "
                        f"(bytes {b * block}-{b * block + len(piece)}) in {store.description}"
                    )
            os.pwrite(fd, data, first * block)
            fetched += len(data)
        os.fsync(fd)
    finally:
        os.close(fd)
    return fetched


def _runs(blocks: list[int], most: int) -> list[tuple[int, int]]:
    """Consecutive block numbers as (first, count), at most `most` blocks a run."""
    runs: list[tuple[int, int]] = []
    for b in blocks:
        if runs and runs[-1][0] + runs[-1][1] == b and runs[-1][1] < most:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs


def _block_ok(data: bytes, digest: str) -> bool:
    return hashlib.sha256(data).hexdigest() == digest


def everyone(step: Callable[[], object]) -> tuple[object, tuple]:
    """Run `step` on this rank, then gather every rank's failure: (kind, message) with kind
    "damage" (bytes that do not verify: the version is quarantined), "store" (the store
    failing) or "error" (anything else: a full disk, a checkpoint the model does not fit).
    Every rank joins the gather whatever `step` raised, so no peer waits forever."""
    import torch.distributed as dist

    result, failure = None, None
    try:
        result = step()
    except (IntegrityError, CheckpointError) as e:
        failure = ("damage", str(e))
    except StoreError as e:
        failure = ("store", str(e))
    except Exception as e:
        failure = ("error", f"rank {dist.get_rank()}: {type(e).__name__}: {e}")
    failures: list = [None] * dist.get_world_size()
    dist.all_gather_object(failures, failure)
    return result, tuple(f for f in failures if f)


def fetch_for_node(store: ArtifactStore, root: Path, ref: Ref, reads: Callable[[Path], Ranges]) -> tuple[Path, tuple]:
    """A collective of every launched rank: each node holds the version's head under `root`,
    then what its ranks' load plans read (`reads(path)`, planned against the head); the node's
    first rank fetches for all of them. (The checkpoint's directory, every rank's failure.)"""
    import torch.distributed as dist

    leader = int(os.environ.get("LOCAL_RANK", "0")) == 0
    node = os.environ.get("GROUP_RANK", "0")

    def head() -> Manifest:  # every rank reads the manifest: a failure of any is said on all
        manifest = store.manifest(ref)
        if leader:
            fetch_head(store, root, manifest)
        return manifest

    manifest, failures = everyone(head)
    if failures:
        return root, failures
    path = root / f"step-{step_of_manifest(manifest)}"
    mine, failures = everyone(lambda: reads(path))
    if failures:
        return path, failures
    plans: list = [None] * dist.get_world_size()
    dist.all_gather_object(plans, (node, mine))

    def shards() -> None:
        if leader:
            fetched = fetch_reads(store, manifest, path, merge([r for n, r in plans if n == node]))
            log.info("node %s fetched %.1f MB of %s", node, fetched / 1e6, ref)

    return path, everyone(shards)[1]
