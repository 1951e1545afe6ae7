"""Token blocks on disk: the Arrow layout the stage writes and the reader training uses.

A dataset version is a directory:
    train/, val/        `datasets.save_to_disk` output, one fixed-size-list column `input_ids`
    tokenizer/          files for `transformers.AutoTokenizer.from_pretrained`
    stats.json          documents in/dropped, tokens and blocks per split, throughput
"""

from __future__ import annotations

import json
from bisect import bisect_right
from pathlib import Path

import numpy as np
import pyarrow as pa

COLUMN = "input_ids"
SPLITS = ("train", "val")


class BlockWriter:
    """Appends (n, block_len) arrays to an Arrow IPC stream file, batch by batch."""

    def __init__(self, path: Path, block_len: int, dtype: np.dtype):
        self.path, self.block_len = Path(path), block_len
        self.schema = pa.schema([(COLUMN, pa.list_(pa.from_numpy_dtype(dtype), block_len))])
        self._sink = pa.OSFile(str(self.path), "wb")
        self._writer = pa.ipc.new_stream(self._sink, self.schema)

    def __call__(self, blocks: np.ndarray) -> None:
        values = pa.array(blocks.reshape(-1))
        arr = pa.FixedSizeListArray.from_arrays(values, self.block_len)
        self._writer.write_batch(pa.record_batch([arr], schema=self.schema))

    def close(self) -> None:
        self._writer.close()
        self._sink.close()


class TokenBlocks:
    """O(1) random access to block i of one split, zero-copy over the memory-mapped Arrow file.

    Resident memory does not grow with the split: nothing is read until a block is
    indexed, and indexing returns a numpy view into the map.
    """

    def __init__(self, path: Path, split: str):
        import datasets

        split_dir = Path(path) / split
        if not split_dir.is_dir():
            raise FileNotFoundError(f"no split {split!r} in dataset {path} (has {sorted(_splits(Path(path)))})")
        if not json.loads((split_dir / "state.json").read_text()).get("_data_files"):
            # datasets writes an empty split as zero shards, which load_from_disk cannot open
            self.block_len, self._chunks, self._starts, self._n = 0, [], [0], 0
            self.dtype = np.dtype(np.uint16)
            return
        ds = datasets.load_from_disk(str(split_dir))
        col = ds.data.table.column(COLUMN)
        self.block_len = col.type.list_size
        self._chunks = [c.flatten().to_numpy(zero_copy_only=True).reshape(-1, self.block_len) for c in col.chunks]
        self._starts = [0]
        for c in self._chunks:
            self._starts.append(self._starts[-1] + len(c))
        self._n = self._starts[-1]
        self._dataset = ds  # keeps the memory map alive
        self.dtype = self._chunks[0].dtype if self._chunks else np.dtype(np.uint16)

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int) -> np.ndarray:
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(f"block {i} out of range for {self._n} blocks")
        c = bisect_right(self._starts, i) - 1
        return self._chunks[c][i - self._starts[c]]


def _splits(path: Path) -> list[str]:
    return [p.name for p in path.iterdir() if p.is_dir()] if path.is_dir() else []


def open_token_blocks(path: str | Path, split: str) -> TokenBlocks:
    return TokenBlocks(Path(path), split)


def load_stats(path: str | Path) -> dict:
    return json.loads((Path(path) / "stats.json").read_text())


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(Path(path) / "tokenizer"))
