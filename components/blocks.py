"""Token blocks on disk: the Arrow layout the tokenize stage writes and the reader the others use.

A dataset version is small: `tokenizer/` (files for `transformers.AutoTokenizer`),
`stats.json`, and a manifest whose `metadata.shards` lists its shard versions. The blocks
live in those shard versions (`shard/NAME/VERSION-<i>of<n>`), one Arrow IPC stream file per
split (`train.arrow`, `val.arrow`) with one fixed-size-list column `input_ids`: a file
`datasets.Dataset.from_file` opens and `pyarrow` memory-maps without a copy. Beside each,
`<split>-tail.npy` holds the shard's last tokens, fewer than a block: never trained on, kept
so that every token of every document is stored exactly once.
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


class ShardFile:
    """O(1) access to block j of one shard file, zero-copy over its memory map: nothing is
    read until a block is indexed, and indexing returns a numpy view into the map."""

    def __init__(self, path: Path, block_len: int):
        self.path = Path(path)
        self._map = pa.memory_map(str(self.path))
        try:
            table = pa.ipc.open_stream(self._map).read_all()
        except pa.ArrowInvalid as e:
            self._map.close()
            raise ValueError(f"{self.path} is not an Arrow block file: {e}") from None
        col = table.column(COLUMN) if COLUMN in table.column_names else None
        if col is None or not pa.types.is_fixed_size_list(col.type) or col.type.list_size != block_len:
            self._map.close()
            raise ValueError(f"{self.path}: expected column {COLUMN!r} of {block_len}-token blocks, got {table.schema}")
        self._chunks = [c.flatten().to_numpy(zero_copy_only=True).reshape(-1, block_len) for c in col.chunks]
        self._starts = [0]
        for c in self._chunks:
            self._starts.append(self._starts[-1] + len(c))
        self._table = table  # keeps the buffers (views into the map) alive

    def __len__(self) -> int:
        return self._starts[-1]

    def __getitem__(self, j: int) -> np.ndarray:
        if not 0 <= j < self._starts[-1]:
            raise IndexError(f"block {j} out of range for {len(self)} blocks in {self.path}")
        c = bisect_right(self._starts, j) - 1
        return self._chunks[c][j - self._starts[c]]

    def close(self) -> None:
        self._chunks, self._table = [], None
        self._map.close()


def load_stats(path: str | Path) -> dict:
    return json.loads((Path(path) / "stats.json").read_text())


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(Path(path) / "tokenizer"))


def first_blocks(blocks, n_blocks: int) -> int:
    """How many blocks `n_blocks` reads: 0 means all of them."""
    return len(blocks) if n_blocks == 0 else min(n_blocks, len(blocks))


def batches(blocks, n_blocks: int, batch_size: int):
    """The first `n_blocks` blocks (0: all) as int64 tensors of up to `batch_size` rows, in
    order: the one loop validate, evaluate and training's val loss read val blocks through."""
    import torch

    n = first_blocks(blocks, n_blocks)
    for start in range(0, n, batch_size):
        rows = range(start, min(n, start + batch_size))
        yield torch.from_numpy(np.stack([blocks[i] for i in rows]).astype(np.int64))
