"""Load, clean and split the source documents of one shard."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from components.config import DataConfig
from components.tokenize.sources import BUILDERS, DataError


def load_documents(cfg: DataConfig, files: list[Path], shard: tuple[int, int] = (0, 1), names: list[str] | None = None):
    """The source as a `datasets.Dataset` with one column, `text`: the given files, or for a
    hub dataset (at data.hub_revision) contiguous part `shard[0]` of `shard[1]`. `names` are
    what errors call the files (a source's URI, not the scratch copy); by default their paths.

    Every parse error is `data.paths: cannot parse <file> line <n> (or row <n>): <reason>`:
    datasets' own error says only "An error occurred while generating the dataset" (the
    parser's row is relative to a block), so when it fails, `why_unparsable` reads the files
    again in one streaming pass to find the first bad line and say what is wrong with it."""
    import datasets

    names = names or [str(f) for f in files]
    if files:
        builder = BUILDERS[files[0].suffix]
        kwargs = {"sample_by": "paragraph"} if builder == "text" else {}
        try:
            ds = datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train", **kwargs)
        except Exception as e:  # datasets wraps parser errors in several types
            raise DataError(f"data.paths: cannot parse {why_unparsable(files, names, builder, e)}") from None
    else:
        ds = datasets.load_dataset(cfg.hub_name, cfg.hub_config, split=cfg.hub_split, revision=cfg.hub_revision)
        ds = ds.shard(shard[1], shard[0], contiguous=True)
    if cfg.text_field not in ds.column_names:
        raise DataError(f"data.text_field: column {cfg.text_field!r} not in the data; it has {ds.column_names}")
    ds = ds.select_columns([cfg.text_field])
    try:
        ds.data.table.column(cfg.text_field).validate(full=True)
    except Exception as e:  # pyarrow.ArrowInvalid: the JSON and Parquet readers pass bad bytes through
        where = first_problem(files, names, BUILDERS[files[0].suffix], cfg.text_field) if files else None
        if where is None:
            where = f"{', '.join(names) or cfg.hub_name} {_bad_row(ds, cfg.text_field, e)}"
        raise DataError(f"data.paths: cannot parse {where}") from None
    return ds.rename_column(cfg.text_field, "text") if cfg.text_field != "text" else ds


def why_unparsable(files: list[Path], names: list[str], builder: str, error: BaseException) -> str:
    """`<file> line <n>: <reason>` for the first bad line of the first bad file; or, when every
    line reads, the parser's own error (the innermost one that says something)."""
    found = first_problem(files, names, builder)
    if found is not None:
        return found
    chain, e = [], error
    while e is not None and len(chain) < 10:
        chain.append(e)
        e = e.__cause__ or e.__context__
    said = [x for x in chain if str(x).strip() and "An error occurred while generating" not in str(x)]
    reason = f"{type(said[0]).__name__}: {str(said[0]).splitlines()[0]}" if said else type(error).__name__
    return f"{', '.join(names)} as {builder}: {reason}"


def first_problem(files: list[Path], names: list[str], builder: str, text_field: str | None = None) -> str | None:
    """The first thing wrong with the files, as `<file> line <n>: <reason>` (`row <n>` in a
    Parquet file), or `<file>: empty file, no documents` when no file holds any; None when
    every file reads. JSONL/text files are read line by line (check_line_lengths has bounded
    the lines). Lines and rows count from 1."""
    lines_with_text = 0
    for path, name in zip(files, names, strict=True):
        if builder == "parquet":
            found = _parquet_problem(path, text_field)
            if found:
                return f"{name} {found}" if found.startswith("row ") else f"{name}: {found}"
            lines_with_text += 1
            continue
        kinds: dict[str, tuple[str, int]] = {}  # top-level key -> (JSON type, first line with it)
        with open(path, "rb") as fh:
            for n, raw in enumerate(fh, 1):
                found = _line_problem(raw, n, builder, kinds)
                if found:
                    return f"{name} line {n}: {found}"
                lines_with_text += bool(raw.strip())
    if not lines_with_text:
        sizes = [p.stat().st_size for p in files]
        what = "empty file" if not any(sizes) else "only blank lines"
        return f"{', '.join(names)}: {what}{'s' if len(files) > 1 and what == 'empty file' else ''}, no documents"
    return None


_JSON_TYPES = {
    str: "a string",
    bool: "a boolean",
    int: "a number",
    float: "a number",
    list: "an array",
    dict: "an object",
}


def _line_problem(raw: bytes, n: int, builder: str, kinds: dict) -> str | None:
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:  # the offset is the byte's within the line
        return f"not UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start})"
    if builder != "json" or not line.strip():
        return None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        return f"not valid JSON ({e.msg}: column {e.colno})"
    if not isinstance(obj, dict):
        return f"not a JSON object but {_JSON_TYPES.get(type(obj), 'null')}"
    for key, value in obj.items():
        if value is None:
            continue
        kind = _JSON_TYPES[type(value)]
        first = kinds.setdefault(key, (kind, n))
        if first[0] != kind:
            return f"{key!r} is {kind}; line {first[1]} has {first[0]}"
    return None


def _parquet_problem(path: Path, text_field: str | None) -> str | None:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # ArrowInvalid: magic bytes, a truncated footer
        return f"not a Parquet file ({str(e).splitlines()[0]})"
    if text_field is None or text_field not in pf.schema_arrow.names:
        return None
    row = 0
    for batch in pf.iter_batches(columns=[text_field], batch_size=8192):
        found = _bad_utf8(batch.column(0))
        if found is not None:
            return f"row {row + found[0] + 1}: {found[1]}"
        row += batch.num_rows
    return None


def _bad_utf8(column) -> tuple[int, str] | None:
    """(index, reason) of the first value of a string column that is not UTF-8."""
    import pyarrow as pa

    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        return None
    for i, value in enumerate(column.cast(pa.large_binary()).to_pylist()):  # bytes: no decoding yet
        if value is None:
            continue
        try:
            value.decode("utf-8")
        except UnicodeDecodeError as e:
            return i, f"not UTF-8 (byte 0x{value[e.start]:02x} at offset {e.start})"
    return None


def _bad_row(ds, text_field: str, error: BaseException) -> str:
    """`row <n>: not UTF-8 (...)` for a hub dataset's (or an unlocated file's) first bad value."""

    row = 0
    for batch in ds.with_format("arrow").iter(batch_size=8192):
        found = _bad_utf8(batch.column(text_field))
        if found is not None:
            return f"row {row + found[0] + 1}: {found[1]}"
        row += batch.num_rows
    return f"column {text_field!r} is not valid UTF-8 ({str(error).splitlines()[0]})"


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
