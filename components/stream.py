"""One split of a dataset version, read shard by shard from the store through a bounded cache.

A rank holds only the shards it reads: each is fetched (sha256-verified) into the node's
cache on first use, the next one in the sample order is fetched in the background while
the current one is read, and the least recently used files are deleted once the cache
would pass its budget. The ranks of one node share the cache: a lock file per shard makes
one of them fetch it while the others wait for that shard only.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout  # not the builtin before 3.11
from pathlib import Path

import numpy as np

from components.blocks import ShardFile
from components.store import ArtifactStore, IntegrityError, Manifest, Ref


class DatasetLayoutError(ValueError):
    """A dataset version that does not list its shards (written by an older liftoff, or edited)."""


def shard_table(manifest: Manifest, split: str) -> list[dict]:
    """[{ref, blocks, bytes}] per shard of `split`, checked against the manifest's own totals."""
    shards = manifest.metadata.get("shards")
    stats = manifest.metadata.get("stats", {})
    if not isinstance(shards, list) or not shards or "block_len" not in stats:
        raise DatasetLayoutError(
            f"{manifest.ref}: its manifest lists no shards (metadata.shards); it was written by an older "
            "liftoff: run tokenize again to make a version in the current layout"
        )
    try:
        rows = [
            {
                "ref": Ref.parse(s["ref"]),
                "blocks": int(s["splits"][split]["blocks"]),
                "bytes": int(s["splits"][split]["bytes"]),
                "source": str(s.get("source") or manifest.ref.name),  # a mixture's rows name their source
            }
            for s in shards
        ]
    except (KeyError, TypeError, ValueError) as e:
        raise DatasetLayoutError(f"{manifest.ref}: bad metadata.shards entry ({e})") from None
    total = stats.get("splits", {}).get(split, {}).get("blocks")
    if total != sum(r["blocks"] for r in rows):
        raise DatasetLayoutError(
            f"{manifest.ref}: its shards hold {sum(r['blocks'] for r in rows)} {split} blocks, its stats say {total}"
        )
    return rows


class StreamingBlocks:
    """Block j of shard s (`block(s, j)`) or global block i (`[i]`, shards in order)."""

    def __init__(
        self,
        store: ArtifactStore,
        manifest: Manifest,
        split: str,
        cache_dir: Path,
        cache_bytes: int,
        on_wait: Callable[[], None] = lambda: None,
    ):
        self.store, self.split, self.cache_bytes, self.on_wait = store, split, int(cache_bytes), on_wait
        self.shards = shard_table(manifest, split)
        stats = manifest.metadata["stats"]
        self.block_len, self.dtype = int(stats["block_len"]), np.dtype(stats["dtype"])
        self.sizes = [r["blocks"] for r in self.shards]
        self._starts = np.cumsum([0] + self.sizes)
        self.cache_dir = Path(cache_dir) / manifest.ref.name / manifest.ref.version / split
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        self._open: dict[int, ShardFile] = {}  # the shards being read, oldest opened first; only the
        # reading thread changes it. A mixture reads a shard of each source at once (`max_open`).
        self.max_open = 1
        self._open_paths: set[Path] = set()
        self._ready: set[Path] = set()  # fetched by this process, not yet opened: not to evict
        self._pending: dict[int, Future] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="shard-prefetch")
        self.fetches = 0  # shards this process downloaded (not found in the node's cache)
        self.fetched_ahead = 0  # of those, fetched by the prefetch thread before the reader needed them

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, i: int) -> np.ndarray:
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"block {i} out of range for {len(self)} blocks")
        s = int(np.searchsorted(self._starts, i, side="right")) - 1
        return self.block(s, i - int(self._starts[s]))

    def block(self, shard: int, j: int) -> np.ndarray:
        """A copy of the block: the map it comes from is closed once the reader moves on."""
        f = self._open.get(shard)
        if f is None:
            f = self._open_shard(shard)
        return f[j].copy()

    def prefetch(self, shard: int) -> None:
        """Fetch a shard in the background (no-op when it is open or already on its way)."""
        with self._lock:
            if shard in self._open or shard in self._pending or self.sizes[shard] == 0:
                return
            self._pending[shard] = self._pool.submit(self._local_file, shard, True)

    def _open_shard(self, shard: int) -> ShardFile:
        with self._lock:
            fut = self._pending.get(shard) or self._pool.submit(self._local_file, shard)
            self._pending[shard] = fut
        while True:  # wait, telling the caller (the watchdog) that data is on its way
            try:
                path = fut.result(timeout=1.0)
                break
            except FutureTimeout:
                self.on_wait()
        with self._lock:
            self._pending.pop(shard, None)
        try:
            f = ShardFile(path, self.block_len)
        except FileNotFoundError:  # another rank of the node evicted it between its check and our open
            return self._open_shard(shard)
        if len(f) != self.sizes[shard]:
            f.close()
            raise IntegrityError(f"{path}: {len(f)} blocks, the dataset lists {self.sizes[shard]}")
        with contextlib.suppress(FileNotFoundError):  # evicted by another rank: our map stays valid
            os.utime(path)  # recency for the node's LRU
        with self._lock:
            while len(self._open) >= self.max_open:  # the oldest opened closes: its space can come back
                self._open.pop(next(iter(self._open))).close()
            self._open[shard] = f
            self._open_paths = {self._path(s) for s in self._open}
            self._ready.discard(path)
        return f

    def _path(self, shard: int) -> Path:
        return self.cache_dir / f"{self.shards[shard]['ref'].version}.arrow"

    def _local_file(self, shard: int, ahead: bool = False) -> Path:
        """The shard's verified file in the node cache, fetched under the node's lock if absent."""
        path, row = self._path(shard), self.shards[shard]
        with open(self.cache_dir / f".{path.name}.lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                if path.is_file() and path.stat().st_size == row["bytes"]:
                    with self._lock:
                        self._ready.add(path)
                    return path  # renamed into place only after its sha256 matched
                with self._lock:
                    keep = {path, *self._open_paths, *self._ready}
                self._evict(row["bytes"], keep)
                manifest = self.store.manifest(row["ref"])
                self.store.fetch_file(manifest, f"{self.split}.arrow", path)
                self.fetches += 1
                self.fetched_ahead += ahead
                with self._lock:
                    self._ready.add(path)
                return path
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _evict(self, incoming: int, keep: set[Path]) -> None:
        """Delete least recently used shard files until `incoming` more bytes fit the budget
        (never the one being read or one fetched and not yet opened): disk stays under the
        budget plus one shard."""
        files = sorted(_cached(self.cache_dir).items(), key=lambda kv: kv[1][1])  # oldest use first
        used = sum(size for size, _ in dict(files).values())
        for p, (size, _) in files:
            if used + incoming <= self.cache_bytes:
                break
            if p in keep:
                continue
            used -= size
            p.unlink(missing_ok=True)  # another rank that maps it keeps reading until it moves on

    def disk_bytes(self) -> int:
        return sum(size for size, _ in _cached(self.cache_dir).values())

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        for f in self._open.values():
            f.close()
        self._open.clear()


def _cached(folder: Path) -> dict[Path, tuple[int, float]]:
    """Shard files in a cache folder: size and last use. Another rank may delete one meanwhile."""
    out = {}
    for p in folder.glob("*.arrow"):
        try:
            st = p.stat()
        except FileNotFoundError:
            continue
        out[p] = (st.st_size, st.st_mtime)
    return out


def open_split(
    store: ArtifactStore, manifest: Manifest, split: str, cache_gb: float | None = None, **kw
) -> StreamingBlocks:
    """A split through the store's cache directory; `cache_gb=None` keeps every shard (small splits)."""
    budget = int(cache_gb * 2**30) if cache_gb is not None else 1 << 62
    return StreamingBlocks(store, manifest, split, store.cache_dir / "stream", budget, **kw)
