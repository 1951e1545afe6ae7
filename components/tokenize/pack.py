"""Tokenize documents in parallel and pack them into fixed blocks with no padding."""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable, Iterator

import numpy as np

MAX_SHARD_DOCS = 2048  # documents per unit of work: bounds memory, amortizes IPC
# Encoding one text costs ~170 bytes of tokenizer memory per byte at once (the normalized
# string's byte alignments, each token's string and offsets), and training the BPE on it
# ~100: a 50 MB line peaked the stage at 12.7 GB. So a long document is encoded in `pieces`
# of at most PIECE_CHARS characters (<= 1 MiB of UTF-8), its ids concatenated (the same ids:
# see `pieces`), one encode_batch call takes at most ENCODE_BATCH_CHARS characters, and the
# BPE trains on the same pieces (plan.sample_texts). The 50 MB line now peaks at ~0.8 GB
# (tests/tokenize/test_long_documents.py). Chunking rather than a lower data.max_doc_bytes
# (which still refuses a longer line before loading): a TB-scale corpus has books and dumps
# far over a few MB, and what a document costs is now what its Arrow copies cost.
PIECE_CHARS = 1 << 18
ENCODE_BATCH_CHARS = 1 << 19


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


def pieces(text: str, size: int | None = None) -> Iterator[str]:
    """`text` in consecutive pieces of at most `size` (PIECE_CHARS) characters that join back to it.

    Each cut falls just before a space that follows a non-space character, where a
    byte-level BPE's pre-tokenizer (GPT-2's regex, and Llama 3's, whose runs of letters,
    digits or punctuation stop at a space and whose tokens never end in one) and Metaspace
    split too: the pieces' ids are the whole text's, and the BPE trained on pieces learns
    the same word counts. A tokenizer whose normalizer prepends to every input (old
    SentencePiece exports: Prepend("▁")) differs from the whole text's encoding by one token
    at each cut. A text with no such space in `size` characters is cut at `size` (such a
    "word" is split: exact only up to that cut).
    """
    size = size or PIECE_CHARS
    start, n = 0, len(text)
    while n - start > size:
        cut = text.rfind(" ", start + 1, start + size + 1)
        for _ in range(1024):  # inside a run of whitespace: before the run (a run of 1024+ is hard cut)
            if cut <= start or not text[cut - 1].isspace():
                break
            cut = text.rfind(" ", start + 1, cut)
        if cut <= start or text[cut - 1].isspace():
            cut = start + size
        yield text[start:cut]
        start = cut
    yield text[start:]


def _encode_shard(start: int) -> tuple[np.ndarray, int]:
    """Documents [start, start + shard_docs) as a flat token array, each followed by EOS.

    Workers read the texts from the memory-mapped Arrow themselves, so the parent only
    packs. A long document is encoded in `pieces`, and each encode_batch call takes at most
    ENCODE_BATCH_CHARS characters. Returns the tokens and how many documents tokenized to
    nothing (left out).
    """
    tok, eos, dtype = _worker["tok"], np.array([_worker["eos"]], dtype=_worker["dtype"]), _worker["dtype"]
    texts = _worker["docs"][start : start + _worker["shard_docs"]]["text"]
    out: list[np.ndarray] = []
    empty = 0
    batch: list[str] = []  # pieces to encode, of the documents in `owners`
    owners: list[int] = []  # the document each piece of the batch belongs to
    doc_ids: dict[int, list[np.ndarray]] = {}  # a document's ids so far, until its last piece is encoded
    last_piece: dict[int, int] = {}  # document -> its number of pieces

    def flush() -> None:
        nonlocal empty
        # _fast: ids without offsets, which no one reads here (~1.5x the speed of encode_batch)
        for doc, e in zip(owners, tok.encode_batch_fast(batch, add_special_tokens=False), strict=True):
            doc_ids.setdefault(doc, []).append(np.array(e.ids, dtype=dtype))
            last_piece[doc] -= 1
            if last_piece[doc] == 0:  # documents finish in order: a piece batch keeps their order
                ids = doc_ids.pop(doc)
                if sum(a.size for a in ids):
                    out.extend([*ids, eos])
                else:
                    empty += 1
                del last_piece[doc]
        batch.clear()
        owners.clear()

    chars = 0
    for doc, text in enumerate(texts):
        parts = [text] if len(text) <= PIECE_CHARS else list(pieces(text))
        last_piece[doc] = len(parts)
        for part in parts:
            if batch and chars + len(part) > ENCODE_BATCH_CHARS:
                flush()
                chars = 0
            batch.append(part)
            owners.append(doc)
            chars += len(part)
    if batch:
        flush()
    return (np.concatenate(out) if out else np.empty(0, dtype=dtype)), empty


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
