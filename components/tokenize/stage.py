"""The tokenize stage: fingerprint the inputs, reuse a stored version or build and publish one."""

from __future__ import annotations

import hashlib
import json
import logging
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from components.blocks import SPLITS, BlockWriter
from components.config import DataConfig, ModelConfig, TokenizerConfig, as_plain_dict
from components.store import ArtifactStore, Manifest, Ref
from components.tokenize.documents import DataError, clean_and_split, load_documents, source_files, source_fingerprint
from components.tokenize.pack import block_dtype, pack_token_blocks, token_shards
from components.tokenize.tokenizer import load_pretrained, save_tokenizer, tokenizer_identity, train_bpe

log = logging.getLogger(__name__)
FORMAT_VERSION = "blocks-v1"  # bump when the on-disk layout or packing changes


@dataclass
class TokenizeResult:
    manifest: Manifest
    path: Path  # local, verified copy of the dataset version
    reused: bool

    @property
    def stats(self) -> dict:
        return self.manifest.metadata["stats"]


def dataset_fingerprint(data: DataConfig, tok: TokenizerConfig, source_hash: str) -> str:
    """Same source + tokenizer + seq_len + filters = same version."""
    ident = {
        "format": FORMAT_VERSION,
        "source": source_hash,
        "text_field": data.text_field,
        "tokenizer": tokenizer_identity(tok),
        "seq_len": data.seq_len,
        "min_chars": data.min_chars,
        "dedup": data.dedup,
        "val_fraction": data.val_fraction,
        "split_seed": data.split_seed,
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


def check_vocab(vocab_size: int, model: ModelConfig, what: str) -> None:
    if model.vocab_size is not None and vocab_size > model.vocab_size:
        raise DataError(f"{what} has {vocab_size} tokens, more than model.vocab_size={model.vocab_size}")


def build_dataset(data: DataConfig, tok_cfg: TokenizerConfig, model: ModelConfig, files: list[Path], out: Path) -> dict:
    """Load, clean, split, tokenize and pack into `out`; return the stats."""
    import datasets

    t0 = time.perf_counter()
    docs = clean_and_split(load_documents(data, files), data)
    tokenizer = load_pretrained(tok_cfg) if tok_cfg.pretrained else train_bpe(_texts(docs.train), tok_cfg)
    check_vocab(len(tokenizer), model, "the tokenizer")
    save_tokenizer(tokenizer, out / "tokenizer")
    dtype = block_dtype(len(tokenizer))
    block_len = data.seq_len + 1
    t_tok = time.perf_counter()
    split_stats, parts = {}, {}
    with tempfile.TemporaryDirectory(dir=out) as scratch:
        for split in ("val", "train"):  # val first: its size check is cheap and fails early
            split_docs = getattr(docs, split)
            writer = BlockWriter(Path(scratch) / f"{split}.arrow", block_len, dtype)
            packed = pack_token_blocks(
                token_shards(split_docs, tokenizer, dtype, data.num_proc), block_len, dtype, writer
            )
            writer.close()
            if packed["blocks"] == 0:
                raise DataError(
                    f"data.seq_len={data.seq_len}: the {split} split has {packed['tokens']} tokens, fewer than one "
                    f"block of {block_len}; lower data.seq_len, raise data.val_fraction or add data"
                )
            split_stats[split] = {"documents": len(split_docs), **packed}
            parts[split] = datasets.Dataset.from_file(str(writer.path))
        datasets.DatasetDict({s: parts[s] for s in SPLITS}).save_to_disk(str(out))
    tok_seconds = time.perf_counter() - t_tok
    total_tokens = sum(s["tokens"] for s in split_stats.values())
    stats = {
        "documents_in": docs.documents_in,
        "dropped": {**docs.dropped, "no_tokens": sum(s["documents_without_tokens"] for s in split_stats.values())},
        "splits": split_stats,
        "vocab_size": len(tokenizer),
        "eos_token_id": tokenizer.eos_token_id,
        "dtype": dtype.name,
        "seq_len": data.seq_len,
        "block_len": block_len,
        "tokens_per_second": total_tokens / tok_seconds,
        "seconds": time.perf_counter() - t0,
    }
    (out / "stats.json").write_text(json.dumps(stats, indent=2))
    return stats


def _texts(ds):
    for batch in ds.iter(batch_size=1000):
        yield from batch["text"]


def run_tokenize(data: DataConfig, tok: TokenizerConfig, model: ModelConfig, store: ArtifactStore) -> TokenizeResult:
    files = source_files(data)
    if not tok.pretrained:
        check_vocab(tok.vocab_size, model, f"tokenizer.vocab_size={tok.vocab_size}: the BPE")
    version = dataset_fingerprint(data, tok, source_fingerprint(data, files))[:16]
    ref = Ref("dataset", data.name, version)
    if store.exists(ref):
        log.info("dataset %s already in %s: reusing it, no tokenization", ref, store.description)
        manifest = store.manifest(ref)
        return TokenizeResult(manifest, store.fetch(manifest), reused=True)
    log.info("tokenizing %s into dataset %s", [str(f) for f in files] or data.hub_name, ref)
    with tempfile.TemporaryDirectory(prefix="liftoff-tokenize-") as tmp:
        out = Path(tmp) / "dataset"
        out.mkdir()
        stats = build_dataset(data, tok, model, files, out)
        metadata = {"stats": stats, "data": as_plain_dict(data), "tokenizer": as_plain_dict(tok)}
        manifest = store.publish("dataset", data.name, version, out, metadata=metadata)
        local = store.fetch(manifest)
    log.info("dataset %s: %s", ref, json.dumps({s: stats["splits"][s]["blocks"] for s in SPLITS}))
    return TokenizeResult(manifest, local, reused=False)
