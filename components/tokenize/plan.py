"""Before the fan-out: identify the source, choose the dataset version, partition the files
into shards and make the tokenizer once (trained on a sample, or a pinned pretrained one).

The plan is published with the tokenizer as `tokenizer/NAME/VERSION` (the dataset's
version): every shard task reads it from the store, so no task depends on another's disk.
"""

from __future__ import annotations

import hashlib
import json
import logging
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

from components.config import DataConfig, ModelConfig, TokenizerConfig, as_plain_dict
from components.store import ArtifactStore, Ref
from components.tokenize.documents import document_keys, load_documents
from components.tokenize.pack import block_dtype, pieces
from components.tokenize.sources import (
    DataError,
    SourceFile,
    check_line_lengths,
    local_copies,
    partition,
    source_files,
    source_identity,
)
from components.tokenize.tokenizer import load_pretrained, save_tokenizer, tokenizer_identity, train_bpe

log = logging.getLogger(__name__)
FORMAT_VERSION = "blocks-v2"  # bump when the on-disk layout or packing changes
PLAN = "plan.json"


@dataclass
class Plan:
    dataset: Ref  # the version the merge publishes
    partitions: list[list[SourceFile]]  # per shard; empty lists for a hub dataset
    vocab_size: int
    eos_token_id: int
    dtype: str
    shared: str | None = None  # a mixture's source: the tokenizer version every source shares

    @property
    def shards(self) -> int:
        return len(self.partitions)

    @property
    def tokenizer(self) -> Ref:
        return Ref("tokenizer", self.dataset.name, self.dataset.version)

    def shard_ref(self, index: int) -> Ref:
        return Ref("shard", self.dataset.name, f"{self.dataset.version}-{index}of{self.shards}")

    def to_json(self) -> str:
        parts = [[f.to_json() for f in p] for p in self.partitions]
        d = {"dataset": str(self.dataset), "partitions": parts, "vocab_size": self.vocab_size}
        d = {**d, "eos_token_id": self.eos_token_id, "dtype": self.dtype}
        return json.dumps({**d, "shared": self.shared} if self.shared else d, indent=1)

    @classmethod
    def from_json(cls, raw: str) -> Plan:
        d = json.loads(raw)
        parts = [[SourceFile.from_json(f) for f in p] for p in d["partitions"]]
        shared = str(Ref.parse(d["shared"])) if d.get("shared") else None
        return cls(Ref.parse(d["dataset"]), parts, int(d["vocab_size"]), int(d["eos_token_id"]), d["dtype"], shared)


def dataset_fingerprint(data: DataConfig, tok: TokenizerConfig, source: dict) -> str:
    """Same source + tokenizer + seq_len + filters + shard count = same version (dedup and the
    packing are per shard, so the shard count is part of what the blocks are)."""
    ident = {
        "format": FORMAT_VERSION,
        "source": source,
        "text_field": data.text_field,
        "tokenizer": tokenizer_identity(tok),
        "seq_len": data.seq_len,
        "min_chars": data.min_chars,
        "dedup": data.dedup,
        "val_fraction": data.val_fraction,
        "split_seed": data.split_seed,
        "shards": data.shards,
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def sample_identity(data: DataConfig, files: list[SourceFile]) -> str:
    """What a BPE's sample of one source depends on: its documents and the filters that pick the
    training ones (not its shards or the block length, which change only the blocks)."""
    ident = {
        "source": source_identity(data, files),
        "text_field": data.text_field,
        "min_chars": data.min_chars,
        "dedup": data.dedup,
        "val_fraction": data.val_fraction,
        "split_seed": data.split_seed,
        "max_doc_bytes": data.max_doc_bytes,
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


def check_vocab(vocab_size: int, model: ModelConfig, what: str) -> None:
    if model.vocab_size is not None and vocab_size > model.vocab_size:
        raise DataError(f"{what} has {vocab_size} tokens, more than model.vocab_size={model.vocab_size}")


def objects_for(cfg: DataConfig, store: ArtifactStore):
    """The client for s3:// sources (the store's endpoint and keys), when the config names any."""
    if not any(p.startswith("s3://") for p in cfg.paths):
        return None
    from components.store import StoreError, object_source

    if store.config is None:
        raise DataError("data.paths names s3:// sources: open the store with open_store(cfg) to reach them")
    try:
        return object_source(store.config)
    except StoreError as e:
        raise DataError(f"data.paths: {e}") from None


def sample_texts(data: DataConfig, files: list[SourceFile], objects, budget_bytes: int, counts: dict):
    """The first `budget_bytes` of usable, distinct training documents in source order: the
    same sample whatever data.shards is, so the tokenizer is too. `counts` gets documents
    read and kept."""
    seen: set[int] = set()
    used = 0
    counts.update(read=0, kept=0)
    for f in files or [None]:
        with tempfile.TemporaryDirectory(prefix="liftoff-sample-") as scratch:
            paths = local_copies([f], objects, Path(scratch)) if f else []
            for p in paths:
                check_line_lengths(p, f.uri, data.max_doc_bytes)
            docs = load_documents(data, paths, names=[f.uri] if f else None)
            for batch in docs.iter(batch_size=1000):
                keys = document_keys(batch, data.min_chars, data.split_seed)
                counts["read"] += len(batch["text"])
                for text, ok, key, draw in zip(batch["text"], keys["usable"], keys["key"], keys["draw"], strict=True):
                    if not ok or draw < data.val_fraction or (data.dedup and key in seen):
                        continue
                    seen.add(key)
                    counts["kept"] += 1
                    yield from pieces(text)  # a long document in pieces: the trainer's memory is bounded
                    used += len(text.encode("utf-8", "surrogatepass"))
                    if used >= budget_bytes:
                        return


def make_plan(data: DataConfig, tok: TokenizerConfig, model: ModelConfig, store: ArtifactStore) -> tuple[Plan, bool]:
    """(the plan, whether the dataset version is already stored). Cheap unless the tokenizer
    must be trained: listing, hashing local files, and the BPE's sample."""
    objects = objects_for(data, store)
    files = source_files(data, objects)
    partitions = partition(files, data.shards)
    if not tok.pretrained:
        check_vocab(tok.vocab_size, model, f"tokenizer.vocab_size={tok.vocab_size}: the BPE")
    dataset = Ref("dataset", data.name, dataset_fingerprint(data, tok, source_identity(data, files)))
    tok_ref = Ref("tokenizer", dataset.name, dataset.version)
    if store.exists(tok_ref):  # planned before: a rerun, or a retry after a shard failed
        stored = store.exists(dataset)
        if stored:
            log.info("dataset %s already in %s: reusing it, no tokenization", dataset, store.description)
        return load_plan(store, tok_ref), stored
    tokenizer = make_tokenizer(tok, [(data, files, objects)])
    check_vocab(len(tokenizer), model, "the tokenizer")
    plan = Plan(dataset, partitions, len(tokenizer), tokenizer.eos_token_id, block_dtype(len(tokenizer)).name)
    publish_plan(plan, tokenizer, tok, store)
    return plan, False


def make_tokenizer(tok: TokenizerConfig, sources: list[tuple[DataConfig, list[SourceFile], object]]):
    """The pinned pretrained tokenizer, or a BPE trained on the first tokenizer.sample_mb of
    training documents, split evenly over the sources (not by the mixture's weights: a sweep
    over the weights keeps the tokenizer, hence every source's blocks)."""
    if tok.pretrained:
        return load_pretrained(tok)
    log.info("training the BPE tokenizer on the first %d MB of training documents", tok.sample_mb)
    counts, read, kept = {}, 0, 0
    budget = (tok.sample_mb << 20) // len(sources)

    def texts():
        nonlocal read, kept
        for data, files, objects in sources:
            yield from sample_texts(data, files, objects, budget, counts)
            read, kept = read + counts["read"], kept + counts["kept"]

    tokenizer = train_bpe(texts(), tok)
    if kept == 0:
        raise DataError(
            f"no usable training documents: {read} read, none longer than data.min_chars="
            f"{sources[0][0].min_chars} outside the val split (the BPE tokenizer trains on them)"
        )
    return tokenizer


def publish_plan(plan: Plan, tokenizer, tok: TokenizerConfig, store: ArtifactStore) -> None:
    """The plan and its tokenizer as `tokenizer/NAME/VERSION`, what every shard task reads."""
    with tempfile.TemporaryDirectory(prefix="liftoff-plan-") as tmp:
        save_tokenizer(tokenizer, Path(tmp) / "tokenizer")
        (Path(tmp) / PLAN).write_text(plan.to_json())
        meta = {"dataset": str(plan.dataset), "shards": plan.shards, "tokenizer": as_plain_dict(tok)}
        parents = [plan.shared] if plan.shared else []
        store.publish("tokenizer", plan.tokenizer.name, plan.tokenizer.version, Path(tmp), metadata=meta,
                      parents=parents)  # fmt: skip


def make_plans(
    data: DataConfig, tok: TokenizerConfig, model: ModelConfig, store: ArtifactStore
) -> tuple[list[Plan], bool]:
    """One plan per source (data.source_names), and whether every source's dataset is stored.

    One source: `make_plan`. A mixture: one tokenizer for all, published as
    `tokenizer/<data.name>/<version>` (its version: the tokenizer's config, and for a trained
    BPE what it samples, every source), which each source's dataset version names: a source
    keeps its version, and is never tokenized again, while the tokenizer and its own files
    and filters stay; the mixture's weights are not part of any of them."""
    if not data.sources:
        plan, stored = make_plan(data, tok, model, store)
        return [plan], stored
    if not tok.pretrained:
        check_vocab(tok.vocab_size, model, f"tokenizer.vocab_size={tok.vocab_size}: the BPE")
    listed = {}
    for name in data.source_names:
        src = data.source(name)
        objects = objects_for(src, store)
        files = source_files(src, objects)
        if files and sum(f.size for f in files) == 0:
            raise DataError(f"data.sources.{name}: no documents: its {len(files)} file(s) are empty")
        listed[name] = (src, files, objects, dataset_fingerprint(src, tok, source_identity(src, files)))
    sampled = [] if tok.pretrained else sorted(sample_identity(s, f) for s, f, _, _ in listed.values())
    ident = {"tokenizer": tokenizer_identity(tok), "sampled": sampled, "format": FORMAT_VERSION}
    shared = Ref("tokenizer", data.name, hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:16])
    plans, stored, tokenizer = [], True, None
    for name, (src, files, _objects, fp) in listed.items():
        version = hashlib.sha256(f"{fp}:{shared.version}".encode()).hexdigest()[:16]
        dataset = Ref("dataset", name, version)
        if store.exists(Ref("tokenizer", name, version)):
            plans.append(load_plan(store, Ref("tokenizer", name, version)))
            stored = stored and store.exists(dataset)
            continue
        partitions = partition(files, src.shards)
        if tokenizer is None:
            tokenizer = shared_tokenizer(shared, tok, [v[:3] for v in listed.values()], store)
            check_vocab(len(tokenizer), model, "the tokenizer")
        dtype = block_dtype(len(tokenizer)).name
        plan = Plan(dataset, partitions, len(tokenizer), tokenizer.eos_token_id, dtype, str(shared))
        publish_plan(plan, tokenizer, tok, store)
        plans.append(plan)
        stored = False
    if stored:
        log.info("every source of %s is in %s: reusing them, no tokenization", data.name, store.description)
    return plans, stored


def shared_tokenizer(ref: Ref, tok: TokenizerConfig, sources: list, store: ArtifactStore):
    """A mixture's tokenizer: the stored version, or made now and published as `ref`."""
    from components.blocks import load_tokenizer

    if store.exists(ref):
        return load_tokenizer(store.fetch(ref))
    tokenizer = make_tokenizer(tok, sources)
    with tempfile.TemporaryDirectory(prefix="liftoff-tokenizer-") as tmp:
        save_tokenizer(tokenizer, Path(tmp) / "tokenizer")
        meta = {"tokenizer": as_plain_dict(tok), "sources": [s[0].name for s in sources]}
        store.publish(ref.kind, ref.name, ref.version, Path(tmp), metadata=meta)
    return tokenizer


def shard_items(plan: Plan, store: ArtifactStore, began: str, data: dict | None = None) -> list[dict]:
    """The ParallelFor's items, one per shard task; KFP's cache (kfp.local's and a cluster's)
    keys a shard task on its item and hands back the shard ref it returned last time, which the
    store may have lost since (a wiped store, an emptied bucket, `artifacts rm`, a lifecycle
    rule). So an item names what it stands on: `planned`, the plan's commit time (a store that
    lost the plan commits it anew: no earlier task's cache entry matches), and, for a shard the
    store lacks although the plan predates this task (`began`), a fresh `rerun` token: that task
    runs again instead of handing back a ref to nothing. A shard of a plan made just now has no
    token, so the next run of the same config is a cache hit. `data`: the source's data group,
    which the shard task reads instead of the pipeline's (whose mixture weights would miss the
    cache when only they change)."""
    planned = store.manifest(plan.tokenizer).created
    stored = store.backend.list_manifests(f"shard/{plan.dataset.name}")
    items, gone = [], 0
    for index in range(plan.shards):
        item = {"plan": str(plan.tokenizer), "index": index, "planned": planned}
        if data is not None:
            item["data"] = data
        if plan.shard_ref(index).version not in stored and planned < began:
            item["rerun"] = uuid.uuid4().hex
            gone += 1
        items.append(item)
    if gone:
        log.warning("%d shard(s) of %s planned before are not in %s: tokenizing them again, whatever "
                    "the pipeline's cache holds", gone, plan.dataset, store.description)  # fmt: skip
    return items


def load_plan(store: ArtifactStore, tokenizer: str | Ref) -> Plan:
    """The plan a shard or merge task works from, fetched (verified) from the store."""
    ref = tokenizer if isinstance(tokenizer, Ref) else Ref.parse(tokenizer)
    return Plan.from_json((store.fetch(ref) / PLAN).read_text())
