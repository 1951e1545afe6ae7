"""One shard of the fan-out: its source files -> cleaned, split, tokenized, packed blocks,
published as `shard/NAME/VERSION-<i>of<n>` (one Arrow file per split)."""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path

import numpy as np

from components.blocks import SPLITS, BlockWriter, load_tokenizer
from components.config import DataConfig
from components.store import ArtifactStore, Manifest
from components.tokenize.documents import clean_and_split, load_documents
from components.tokenize.pack import pack_token_blocks, token_shards
from components.tokenize.plan import Plan, objects_for
from components.tokenize.sources import check_line_lengths, local_copies

log = logging.getLogger(__name__)


class ShardError(RuntimeError):
    """A shard that could not be built; names the shard and its source files."""


def shard_label(plan: Plan, index: int) -> str:
    files = plan.partitions[index]
    names = ", ".join(f.uri for f in files[:5]) + (f" and {len(files) - 5} more" if len(files) > 5 else "")
    return f"shard {index + 1}/{plan.shards} of {plan.dataset} ({names or 'hub rows'})"


def build_shard(plan: Plan, index: int, data: DataConfig, tokenizer, objects, out: Path) -> dict:
    """Build shard `index` into `out` (train.arrow, val.arrow); return its stats."""
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="liftoff-sources-") as scratch:
        files = plan.partitions[index]
        paths = local_copies(files, objects, Path(scratch))  # objects downloaded: this shard's bytes only
        for f, p in zip(files, paths, strict=True):
            check_line_lengths(p, f.uri, data.max_doc_bytes)
        docs = clean_and_split(load_documents(data, paths, (index, plan.shards), [f.uri for f in files]), data)
        dtype, block_len = np.dtype(plan.dtype), data.seq_len + 1
        splits = {}
        t_tok = time.perf_counter()
        for split in SPLITS:
            split_docs = getattr(docs, split)
            writer = BlockWriter(out / f"{split}.arrow", block_len, dtype)
            packed = pack_token_blocks(
                token_shards(split_docs, tokenizer, dtype, data.num_proc), block_len, dtype, writer
            )
            writer.close()
            size = writer.path.stat().st_size
            np.save(out / f"{split}-tail.npy", packed.pop("tail"), allow_pickle=False)
            splits[split] = {"documents": len(split_docs), "bytes": size, **packed}
        tok_seconds = time.perf_counter() - t_tok
    tokens = sum(s["tokens"] for s in splits.values())
    return {
        "documents_in": docs.documents_in,
        "dropped": {**docs.dropped, "no_tokens": sum(s["documents_without_tokens"] for s in splits.values())},
        "splits": splits,
        "tokens_per_second": tokens / tok_seconds if tok_seconds > 0 else 0.0,
        "seconds": time.perf_counter() - t0,
    }


def run_shard(plan: Plan, index: int, data: DataConfig, store: ArtifactStore) -> tuple[Manifest, bool]:
    """(the shard's manifest, whether it was already stored). Nothing is published when the
    shard fails; the error names the shard and its files."""
    ref = plan.shard_ref(index)
    if store.exists(ref):
        return store.manifest(ref), True
    try:
        tokenizer = load_tokenizer(store.fetch(plan.tokenizer))
        with tempfile.TemporaryDirectory(prefix="liftoff-shard-") as tmp:
            stats = build_shard(plan, index, data, tokenizer, objects_for(data, store), Path(tmp))
            meta = {"stats": stats, "dataset": str(plan.dataset), "index": index, "of": plan.shards}
            meta["sources"] = [f.to_json() for f in plan.partitions[index]]
            manifest = store.publish(
                ref.kind, ref.name, ref.version, Path(tmp), metadata=meta, parents=[str(plan.tokenizer)]
            )
    except Exception as e:
        raise ShardError(f"{shard_label(plan, index)}: {e}") from e
    log.info("%s: %s", ref, {s: stats["splits"][s]["blocks"] for s in SPLITS})
    return manifest, False
