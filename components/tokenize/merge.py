"""After the fan-out: one dataset version that lists the shards, with no block copied."""

from __future__ import annotations

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
    if sum(splits[s]["documents"] for s in SPLITS) == 0:
        read = sum(p["documents_in"] for p in per)
        raise DataError(f"no usable documents: {read} read, dropped {dropped} (data.min_chars={data.min_chars})")
    for split in ("val", "train"):
        if splits[split]["blocks"] == 0:
            raise DataError(
                f"data.seq_len={data.seq_len}: the {split} split has {splits[split]['tokens']} tokens, fewer than one "
                f"block of {block_len}; lower data.seq_len, raise data.val_fraction or add data"
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
