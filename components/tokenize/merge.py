"""After the fan-out: one dataset version that lists the shards, with no block copied."""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

from components.blocks import SPLITS
from components.config import DataConfig, TokenizerConfig, as_plain_dict
from components.store import ArtifactStore, IntegrityError, Manifest, Ref
from components.tokenize.plan import PLAN, Plan
from components.tokenize.sources import DataError


def _shard_manifests(plan: Plan, shard_refs: list[str], store: ArtifactStore) -> list[Manifest]:
    """The shard versions, checked: exactly this plan's shards, each once, each complete."""
    want = {str(plan.shard_ref(i)): i for i in range(plan.shards)}
    given = [str(Ref.parse(r)) for r in shard_refs]
    if sorted(given) != sorted(want):
        missing, extra = sorted(set(want) - set(given)), sorted(set(given) - set(want))
        raise IntegrityError(f"merge of {plan.dataset}: shards missing {missing}, unexpected {extra}")
    manifests = [store.manifest(Ref.parse(r)) for r in sorted(given, key=want.get)]
    for m in manifests:
        for split in SPLITS:
            entry, listed = m.files.get(f"{split}.arrow"), m.metadata["stats"]["splits"][split]
            if entry is None or entry["size"] != listed["bytes"]:
                raise IntegrityError(f"{m.ref}: its {split}.arrow does not match its stats")
    return manifests


def dataset_stats(plan: Plan, shards: list[Manifest], data: DataConfig) -> dict:
    per = [m.metadata["stats"] for m in shards]
    splits = {
        s: {k: sum(p["splits"][s][k] for p in per) for k in ("documents", "tokens", "blocks", "bytes")} for s in SPLITS
    }
    dropped: dict[str, int] = {}
    for p in per:
        for k, v in p["dropped"].items():
            dropped[k] = dropped.get(k, 0) + v
    block_len = data.seq_len + 1
    source = f"data.sources.{data.name}: " if plan.shared else ""  # a mixture's source
    if sum(splits[s]["documents"] for s in SPLITS) == 0:
        read = sum(p["documents_in"] for p in per)
        raise DataError(
            f"{source}no usable documents: {read} read, dropped {dropped} (data.min_chars={data.min_chars})"
        )
    for split in ("val", "train"):
        if splits[split]["blocks"] == 0:
            raise DataError(
                f"{source}data.seq_len={data.seq_len}: the {split} split has {splits[split]['tokens']} tokens, fewer "
                f"than one block of {block_len}; lower data.seq_len, raise data.val_fraction or add data"
            )
    return {
        "documents_in": sum(p["documents_in"] for p in per),
        "dropped": dropped,
        "splits": splits,
        "shards": plan.shards,
        "vocab_size": plan.vocab_size,
        "eos_token_id": plan.eos_token_id,
        "dtype": plan.dtype,
        "seq_len": data.seq_len,
        "block_len": block_len,
        # per shard task, each on its own pod: how fast one shard tokenizes, and the slowest shard
        "tokens_per_second_per_shard": sum(p["tokens_per_second"] for p in per) / len(per),
        "slowest_shard_seconds": max(p["seconds"] for p in per),
    }


def merge_shards(
    plan: Plan, shard_refs: list[str], data: DataConfig, tok: TokenizerConfig, store: ArtifactStore
) -> tuple[Manifest, bool]:
    """(the dataset version, whether it was already stored). Publish it: tokenizer files and
    stats, and `metadata.shards` naming each shard version with its blocks, tokens and bytes
    per split. Lineage: the tokenizer and the shards."""
    if store.exists(plan.dataset):
        return store.manifest(plan.dataset), True
    shards = _shard_manifests(plan, shard_refs, store)
    stats = dataset_stats(plan, shards, data)
    listing = [
        {
            "ref": str(m.ref),
            "splits": {
                s: {k: m.metadata["stats"]["splits"][s][k] for k in ("blocks", "tokens", "bytes")} for s in SPLITS
            },
        }
        for m in shards
    ]
    with tempfile.TemporaryDirectory(prefix="liftoff-merge-") as tmp:
        out = Path(tmp)
        shutil.copytree(store.fetch(plan.tokenizer) / "tokenizer", out / "tokenizer")
        (out / "stats.json").write_text(json.dumps(stats, indent=2))
        (out / PLAN).write_text(plan.to_json())
        meta = {"stats": stats, "shards": listing, "data": as_plain_dict(data), "tokenizer": as_plain_dict(tok)}
        ref = plan.dataset
        parents = [str(plan.tokenizer), *(str(m.ref) for m in shards)]
        return store.publish(ref.kind, ref.name, ref.version, out, metadata=meta, parents=parents), False


def merge_all(
    plans: list[Plan], shard_refs: list[str], data: DataConfig, tok: TokenizerConfig, store: ArtifactStore
) -> tuple[Manifest, bool]:
    """The dataset the run trains on: one source's version, or a mixture's corpus over its
    sources' versions (each merged from its own shards first)."""
    if not data.sources:
        return merge_shards(plans[0], shard_refs, data, tok, store)
    merged = []
    for plan in plans:
        mine = [r for r in shard_refs if Ref.parse(r).name == plan.dataset.name]
        merged.append(merge_shards(plan, mine, data.source(plan.dataset.name), tok, store)[0])
    return publish_corpus(data, merged, tok, store)


def publish_corpus(
    data: DataConfig, sources: list[Manifest], tok: TokenizerConfig, store: ArtifactStore
) -> tuple[Manifest, bool]:
    """`dataset/<data.name>@<version>`: the sources' dataset versions side by side, no block
    copied. `metadata.shards` lists every source's shards, each row naming its `source`;
    `metadata.sources` names each source's version. Its version is the sources' versions only:
    the mixture's weights are chosen at train time and recorded with the model."""
    refs = {m.ref.name: str(m.ref) for m in sources}
    version = hashlib.sha256(json.dumps(refs, sort_keys=True).encode()).hexdigest()[:16]
    ref = Ref("dataset", data.name, version)
    if store.exists(ref):
        return store.manifest(ref), True
    stats = [m.metadata["stats"] for m in sources]
    splits = {s: {k: sum(st["splits"][s][k] for st in stats) for k in stats[0]["splits"][s]} for s in SPLITS}
    shared = {k: stats[0][k] for k in ("vocab_size", "eos_token_id", "dtype", "seq_len", "block_len")}
    corpus_stats = {
        **shared,
        "splits": splits,
        "documents_in": sum(st["documents_in"] for st in stats),
        "shards": sum(st["shards"] for st in stats),
        "dropped": {
            k: sum(st["dropped"].get(k, 0) for st in stats) for k in sorted({k for st in stats for k in st["dropped"]})
        },
        "sources": {m.ref.name: m.metadata["stats"]["splits"] for m in sources},
    }
    listing = [{**row, "source": m.ref.name} for m in sources for row in m.metadata["shards"]]
    plain = {k: v for k, v in as_plain_dict(data).items() if k != "mixture"}
    with tempfile.TemporaryDirectory(prefix="liftoff-corpus-") as tmp:
        out = Path(tmp)
        shutil.copytree(store.fetch(sources[0].ref) / "tokenizer", out / "tokenizer")
        (out / "stats.json").write_text(json.dumps(corpus_stats, indent=2))
        meta = {
            "stats": corpus_stats,
            "shards": listing,
            "sources": refs,
            "data": plain,
            "tokenizer": as_plain_dict(tok),
        }
        return store.publish(ref.kind, ref.name, ref.version, out, metadata=meta, parents=list(refs.values())), False
