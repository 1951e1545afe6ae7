"""Find, load, clean and split the source documents."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

from components.config import DataConfig

BUILDERS = {".jsonl": "json", ".json": "json", ".txt": "text", ".parquet": "parquet"}


class DataError(ValueError):
    """Source data that cannot make a dataset; raised before any heavy work."""


def source_files(cfg: DataConfig) -> list[Path]:
    """Every file the config names, expanded from directories, all of one readable format."""
    files: list[Path] = []
    for raw in cfg.paths:
        p = Path(raw).expanduser()
        if not p.exists():
            raise DataError(f"data.paths: {raw} does not exist")
        found = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in BUILDERS) if p.is_dir() else [p]
        if p.is_dir() and not found:
            raise DataError(f"data.paths: directory {raw} has no {'/'.join(BUILDERS)} files")
        files.extend(found)
    for f in files:
        if f.suffix not in BUILDERS:
            raise DataError(f"data.paths: {f} is not one of {', '.join(BUILDERS)}")
        if not os.access(f, os.R_OK):
            raise DataError(f"data.paths: {f} is not readable")
    builders = {BUILDERS[f.suffix] for f in files}
    if len(builders) > 1:
        raise DataError(f"data.paths mixes formats ({', '.join(sorted(builders))}); use one per dataset")
    return files


def source_fingerprint(cfg: DataConfig, files: list[Path]) -> str:
    """Hash of the source content (or the hub name and revision) the documents come from.

    The same streaming pass refuses a text file with a line longer than data.max_doc_bytes,
    before `datasets` would hold that whole line in memory.
    """
    h = hashlib.sha256()
    if files:
        for f in files:
            h.update(f.name.encode() + b"\0")
            longest = current = 0  # bytes of the longest finished line, and of the line being read
            try:
                with open(f, "rb") as fh:
                    while chunk := fh.read(1 << 20):
                        h.update(chunk)
                        if f.suffix == ".parquet":
                            continue
                        parts = chunk.split(b"\n")
                        current += len(parts[0])
                        if len(parts) > 1:
                            longest = max(longest, current, *(len(p) for p in parts[1:-1]))
                            current = len(parts[-1])
                        if max(longest, current) > cfg.max_doc_bytes:
                            raise DataError(
                                f"data.paths: {f} has a line longer than data.max_doc_bytes="
                                f"{cfg.max_doc_bytes}; split it into documents or raise the limit"
                            )
            except OSError as e:
                raise DataError(f"data.paths: cannot read {f}: {e.strerror}") from None
    else:
        h.update(f"hub:{cfg.hub_name}:{cfg.hub_config}:{cfg.hub_split}".encode())
    return h.hexdigest()


def load_documents(cfg: DataConfig, files: list[Path]):
    """The source as a `datasets.Dataset` with one column, `text`."""
    import datasets

    if files:
        builder = BUILDERS[files[0].suffix]
        kwargs = {"sample_by": "paragraph"} if builder == "text" else {}
        try:
            ds = datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train", **kwargs)
        except Exception as e:  # datasets wraps parser errors in several types
            raise DataError(f"data.paths: cannot parse {', '.join(map(str, files))} as {builder}: {e}") from None
    else:
        ds = datasets.load_dataset(cfg.hub_name, cfg.hub_config, split=cfg.hub_split)
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


def _document_keys(batch: dict, min_chars: int, seed: int) -> dict:
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
    reordered and puts exact duplicates on one side. Texts stay in Arrow; only one
    64-bit key per document is held in memory.
    """
    import numpy as np

    keyed = ds.map(
        _document_keys,
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
    if kept.size == 0:
        raise DataError(f"no usable documents: {len(ds)} read, dropped {dropped} (data.min_chars={cfg.min_chars})")
    is_val = draws[kept] < cfg.val_fraction
    if not is_val.any():  # a tiny corpus can hash nothing below val_fraction: move one document
        is_val[np.argmin(draws[kept])] = True
    if is_val.all():
        raise DataError(f"only {kept.size} usable document(s): none left for training after the val split")
    return Documents(ds.select(kept[~is_val]), ds.select(kept[is_val]), len(ds), dropped)


def _procs(cfg: DataConfig, n: int) -> int | None:
    return cfg.num_proc if cfg.num_proc > 1 and n >= 1000 * cfg.num_proc else None
