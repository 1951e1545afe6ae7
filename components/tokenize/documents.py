"""Load, clean and split the source documents of one shard."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from components.config import DataConfig
from components.tokenize.sources import BUILDERS, DataError


def load_documents(cfg: DataConfig, files: list[Path], shard: tuple[int, int] = (0, 1)):
    """The source as a `datasets.Dataset` with one column, `text`: the given files, or for a
    hub dataset (at data.hub_revision) contiguous part `shard[0]` of `shard[1]`."""
    import datasets

    if files:
        builder = BUILDERS[files[0].suffix]
        kwargs = {"sample_by": "paragraph"} if builder == "text" else {}
        try:
            ds = datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train", **kwargs)
        except Exception as e:  # datasets wraps parser errors in several types
            raise DataError(f"data.paths: cannot parse {', '.join(map(str, files))} as {builder}: {e}") from None
    else:
        ds = datasets.load_dataset(cfg.hub_name, cfg.hub_config, split=cfg.hub_split, revision=cfg.hub_revision)
        ds = ds.shard(shard[1], shard[0], contiguous=True)
    if cfg.text_field not in ds.column_names:
        raise DataError(f"data.text_field: column {cfg.text_field!r} not in the data; it has {ds.column_names}")
    ds = ds.select_columns([cfg.text_field])
    try:
        ds.data.table.column(cfg.text_field).validate(full=True)
    except Exception as e:  # pyarrow.ArrowInvalid: the JSON/text readers pass bad bytes through
        where = ", ".join(map(str, files)) or cfg.hub_name
        raise DataError(
            f"data.paths: cannot parse {where}: column {cfg.text_field!r} is not valid UTF-8 ({str(e).splitlines()[0]})"
        ) from None
    return ds.rename_column(cfg.text_field, "text") if cfg.text_field != "text" else ds


@dataclass
class Documents:
    train: object  # datasets.Dataset with a `text` column
    val: object
    documents_in: int
    dropped: dict[str, int] = field(default_factory=dict)


def document_keys(batch: dict, min_chars: int, seed: int) -> dict:
    keys, split_draws, usable = [], [], []
    for text in batch["text"]:
        ok = isinstance(text, str) and len(text.strip()) >= min_chars
        usable.append(ok)
        raw = text.encode("utf-8", "surrogatepass") if ok else b""
        keys.append(int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "big", signed=True))
        seeded = hashlib.blake2b(raw, digest_size=8, key=str(seed).encode()).digest()
        split_draws.append(int.from_bytes(seeded, "big") / 2**64)
    return {"usable": usable, "key": keys, "draw": split_draws}


def clean_and_split(ds, cfg: DataConfig) -> Documents:
    """Drop short and duplicate documents, then split by a hash of each document's text.

    Hashing the text (not the position) keeps the split stable when the source is
    reordered or partitioned into another number of shards, and puts exact duplicates on
    one side. Dedup is within this shard's documents. Texts stay in Arrow; only one 64-bit
    key per document is held in memory. Empty results are the merge's to judge.
    """
    import numpy as np

    keyed = ds.map(
        document_keys,
        batched=True,
        num_proc=_procs(cfg, len(ds)),
        fn_kwargs={"min_chars": cfg.min_chars, "seed": cfg.split_seed},
        desc="hashing documents",
    )
    cols = keyed.with_format("numpy", columns=["usable", "key", "draw"])
    usable, keys, draws = (np.asarray(cols[c][:]) for c in ("usable", "key", "draw"))
    usable = usable.astype(bool)
    dropped = {"empty_or_short": int((~usable).sum())}
    kept = np.flatnonzero(usable)
    if cfg.dedup and kept.size:
        _, first = np.unique(keys[kept], return_index=True)
        dropped["duplicate"] = int(kept.size - first.size)
        kept = np.sort(kept[first])
    is_val = draws[kept] < cfg.val_fraction  # nothing moved between splits: the merge judges the totals
    return Documents(ds.select(kept[~is_val]), ds.select(kept[is_val]), len(ds), dropped)


def _procs(cfg: DataConfig, n: int) -> int | None:
    return cfg.num_proc if cfg.num_proc > 1 and n >= 1000 * cfg.num_proc else None
