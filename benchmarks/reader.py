"""reader: random block reads/s from `ShardFile` (the zero-copy map of one shard's Arrow file,
what the streaming reader opens once a shard is in the node's cache) vs plain ndarray views of
a numpy memmap of the same tokens.

The shard file is written by `BlockWriter` as tokenize writes one (record batches of 1000
blocks). Both sides read the same random block indices and copy each block into an int64
array, as the training loader does. Also prints resident memory after opening and reading from a 1x
and a 10x dataset: it must stay flat (the reader maps the file, it does not load it).
Target ratio >= 0.8.
"""

from __future__ import annotations

import gc
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import report, rss_mb

BLOCK = 2049
BASE_BLOCKS = int(os.environ.get("BENCH_READER_BLOCKS", "12000"))  # 1x: ~49 MB of uint16 tokens
READS = 50_000


def write_dataset(root: Path, n_blocks: int) -> Path:
    """The same random tokens as a shard file (returned) and a flat uint16 file (root/flat.u16)."""
    from components.blocks import BlockWriter

    rng = np.random.default_rng(0)
    arrow = root / "train.arrow"
    writer = BlockWriter(arrow, BLOCK, np.dtype(np.uint16))
    with open(root / "flat.u16", "wb") as flat:
        for start in range(0, n_blocks, 1000):
            part = rng.integers(0, 50000, size=(min(1000, n_blocks - start), BLOCK), dtype=np.uint16)
            writer(part)
            flat.write(part.tobytes())
    writer.close()
    return arrow


def reads_per_second(get, idx: np.ndarray) -> float:
    t0 = time.perf_counter()
    for i in idx:
        np.asarray(get(int(i)), dtype=np.int64)
    return len(idx) / (time.perf_counter() - t0)


def main() -> None:
    from components.blocks import ShardFile

    results, rss = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for scale in (1, 10):
            root = Path(tmp) / f"x{scale}"
            root.mkdir()
            n = BASE_BLOCKS * scale
            arrow = write_dataset(root, n)
            idx = np.random.default_rng(1).integers(0, n, size=READS)
            before = rss_mb("RssAnon")
            blocks = ShardFile(arrow, BLOCK)
            ours = reads_per_second(blocks.__getitem__, idx)
            rss[scale] = rss_mb("RssAnon") - before
            # the baseline indexes a plain ndarray view of the map: np.memmap's own __getitem__
            # builds a memmap subclass per index, which made the baseline slower than numpy is
            flat = np.memmap(root / "flat.u16", dtype=np.uint16, mode="r", shape=(n, BLOCK)).view(np.ndarray)
            np.testing.assert_array_equal(blocks[int(idx[0])], flat[int(idx[0])])  # same tokens both sides
            base = reads_per_second(flat.__getitem__, idx)
            results[scale] = (ours, base)
            blocks.close()
            del blocks, flat
            gc.collect()
            size_mb = n * BLOCK * 2 / 1e6
            print(
                f"{scale:>2}x ({size_mb:,.0f} MB): ShardFile {ours:,.0f} reads/s, numpy memmap {base:,.0f} "
                f"reads/s, anonymous memory growth {rss[scale]:.1f} MB"
            )
    print(f"anonymous memory growth 1x -> 10x: {rss[1]:.1f} MB -> {rss[10]:.1f} MB", file=sys.stderr)
    ours, base = results[10]
    report("reader", ours, base, "reads/s", rss_growth_mb_1x=round(rss[1], 1), rss_growth_mb_10x=round(rss[10], 1))


if __name__ == "__main__":
    main()
