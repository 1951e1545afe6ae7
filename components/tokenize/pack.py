"""Tokenize documents in parallel and pack them into fixed blocks with no padding."""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable, Iterator

import numpy as np

MAX_SHARD_DOCS = 2048  # documents per unit of work: bounds memory, amortizes IPC


def block_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned integer type that holds every token id."""
    for dt in (np.uint16, np.uint32):
        if vocab_size - 1 <= np.iinfo(dt).max:
            return np.dtype(dt)
    return np.dtype(np.uint64)


_worker: dict = {}


def _init_worker(docs, shard_docs: int, tokenizer_json: str, eos_id: int, dtype: str) -> None:
    from tokenizers import Tokenizer

    _worker.update(
        docs=docs, shard_docs=shard_docs, tok=Tokenizer.from_str(tokenizer_json), eos=eos_id, dtype=np.dtype(dtype)
    )


def _encode_shard(start: int) -> tuple[np.ndarray, int]:
    """Documents [start, start + shard_docs) as a flat token array, each followed by EOS.

    Workers read the texts from the memory-mapped Arrow themselves, so the parent only
    packs. Returns the tokens and how many documents tokenized to nothing (left out).
    """
    texts = _worker["docs"][start : start + _worker["shard_docs"]]["text"]
    encoded = _worker["tok"].encode_batch(texts, add_special_tokens=False)
    flat: list[int] = []
    empty = 0
    for e in encoded:
        ids = e.ids
        if ids:
            flat.extend(ids)
            flat.append(_worker["eos"])
        else:
            empty += 1
    return np.array(flat, dtype=_worker["dtype"]), empty


def token_shards(docs, tokenizer, dtype: np.dtype, num_proc: int) -> Iterator[tuple[np.ndarray, int]]:
    """Flat token arrays shard by shard, in document order, from num_proc worker processes."""
    shard_docs = max(1, min(MAX_SHARD_DOCS, -(-len(docs) // (4 * num_proc))))  # >= 4 shards per worker
    init = (docs, shard_docs, tokenizer.backend_tokenizer.to_str(), tokenizer.eos_token_id, dtype.str)
    starts = range(0, len(docs), shard_docs)
    if num_proc <= 1:
        _init_worker(*init)
        yield from map(_encode_shard, starts)
        return
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one tokenizer thread per worker
    with mp.get_context("fork").Pool(num_proc, initializer=_init_worker, initargs=init) as pool:
        yield from pool.imap(_encode_shard, starts, chunksize=1)


def pack_token_blocks(shards, block_len: int, dtype: np.dtype, write: Callable[[np.ndarray], None]) -> dict:
    """Stream token shards into consecutive blocks of block_len tokens.

    `write(blocks)` receives (n, block_len) arrays in order; the tail shorter than one
    block comes back as "tail" (kept beside the blocks, never trained on). Memory stays at
    one shard plus one partial block.
    """
    carry = np.empty(0, dtype=dtype)
    tokens = blocks = empty_docs = 0
    for flat, empty in shards:
        tokens += flat.size
        empty_docs += empty
        stream = np.concatenate([carry, flat]) if carry.size else flat
        n = stream.size // block_len
        if n:
            write(stream[: n * block_len].reshape(n, block_len))
            blocks += n
        carry = stream[n * block_len :]
    return {"tokens": tokens, "blocks": blocks, "documents_without_tokens": empty_docs, "tail": carry}
