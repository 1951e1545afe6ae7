"""Where the documents come from: local files, objects under s3:// prefixes, or a hub dataset
pinned by revision, each identified cheaply and exactly for the dataset version."""

from __future__ import annotations

import hashlib
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from components.config import DataConfig

BUILDERS = {".jsonl": "json", ".json": "json", ".txt": "text", ".parquet": "parquet"}


class DataError(ValueError):
    """Source data that cannot make a dataset; raised before any heavy work."""


@dataclass(frozen=True)
class SourceFile:
    """One source file: where it is, and what identifies its content.

    `digest` is the MD5 of the bytes: for a local file computed here, for an object its
    ETag, which S3 and MinIO set to the MD5 of an object uploaded in one part, so the same
    bytes make the same dataset version wherever they are. A multipart upload's ETag
    (`<md5 of part md5s>-<parts>`) depends on the part size: that object identifies as a
    new version even when its bytes equal a local file's.
    """

    uri: str  # a local absolute path or s3://bucket/key
    relpath: str  # its name under the data.paths entry it was found in
    size: int
    digest: str

    @property
    def suffix(self) -> str:
        return Path(self.relpath).suffix

    @property
    def is_object(self) -> bool:
        return self.uri.startswith("s3://")

    def identity(self) -> dict:
        return {"name": self.relpath, "size": self.size, "md5": self.digest}

    @classmethod
    def from_json(cls, d: dict) -> SourceFile:
        """One entry of a stored plan, checked: it names a file, never a way out of a folder."""
        from components.store import check_relpath, parse_s3_url

        f = cls(str(d["uri"]), check_relpath(str(d["relpath"])), int(d["size"]), str(d["digest"]))
        if f.is_object:
            parse_s3_url(f.uri)
        elif not Path(f.uri).is_absolute() or ".." in Path(f.uri).parts:
            raise ValueError(f"plan names a local source {f.uri!r} that is not an absolute path")
        return f

    def to_json(self) -> dict:
        return asdict(self)


def _md5(path: Path) -> str:
    h = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def local_paths(p: Path) -> list[Path]:
    """The files a local data.paths entry names: the file itself, or every file of a known
    format under the directory."""
    if p.is_dir():
        return sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in BUILDERS)
    return [p]


def _local_files(raw: str) -> list[SourceFile]:
    p = Path(raw).expanduser()
    if not p.exists():
        raise DataError(f"data.paths: {raw} does not exist")
    if p.is_dir():
        found = local_paths(p)
        if not found:
            raise DataError(f"data.paths: directory {raw} has no {'/'.join(BUILDERS)} files")
        named = [(f, f.relative_to(p).as_posix()) for f in found]
    else:
        named = [(p, p.name)]
    out = []
    for f, rel in named:
        if not os.access(f, os.R_OK):
            raise DataError(f"data.paths: {f} is not readable")
        try:
            out.append(SourceFile(str(f.resolve()), rel, f.stat().st_size, _md5(f)))
        except OSError as e:
            raise DataError(f"data.paths: cannot read {f}: {e.strerror}") from None
    return out


def _object_files(url: str, objects) -> list[SourceFile]:
    from components.store import NotFound, StoreError

    try:
        listed = objects.list(url)
    except NotFound:
        raise DataError(f"data.paths: {url} has no objects") from None
    except StoreError as e:
        raise DataError(f"data.paths: {url}: {e}") from None
    found = [SourceFile(o.url, o.relpath, o.size, o.etag) for o in listed if Path(o.relpath).suffix in BUILDERS]
    if not found:
        raise DataError(f"data.paths: {url} has no {'/'.join(BUILDERS)} objects")
    return found


def source_files(cfg: DataConfig, objects=None) -> list[SourceFile]:
    """Every file the config names, expanded from directories and prefixes, all of one format.
    `objects` lists and downloads s3:// sources (`components.store.object_source`)."""
    files: list[SourceFile] = []
    for raw in cfg.paths:
        if raw.startswith("s3://"):
            if objects is None:
                raise DataError(f"data.paths: {raw} needs the store's S3 endpoint (store.backend=minio)")
            files.extend(_object_files(raw, objects))
        else:
            files.extend(_local_files(raw))
    for f in files:
        if f.suffix not in BUILDERS:
            raise DataError(f"data.paths: {f.uri} is not one of {', '.join(BUILDERS)}")
    seen: dict[str, str] = {}
    for f in files:
        if f.relpath in seen:
            raise DataError(
                f"data.paths: {seen[f.relpath]} and {f.uri} have the same name {f.relpath!r} under their "
                "entries; a dataset's files need distinct names"
            )
        seen[f.relpath] = f.uri
    builders = {BUILDERS[f.suffix] for f in files}
    if len(builders) > 1:
        raise DataError(f"data.paths mixes formats ({', '.join(sorted(builders))}); use one per dataset")
    return files


def source_identity(cfg: DataConfig, files: list[SourceFile]) -> dict:
    """What the documents are, for the dataset version: file names, sizes and MD5s, or the
    hub dataset with its revision."""
    if files:
        return {"files": [f.identity() for f in files]}
    return {"hub": [cfg.hub_name, cfg.hub_config, cfg.hub_split, cfg.hub_revision]}


def partition(files: list[SourceFile], shards: int) -> list[list[SourceFile]]:
    """File k (in source order) to shard k mod shards: each shard a mix of the whole listing
    (a corpus laid out as cc/..., wiki/... does not put one source in one shard), balanced in
    bytes when the files are of a size, as part files are. A file is never split."""
    if not files:
        return [[] for _ in range(shards)]  # a hub dataset: shard i takes contiguous row range i
    if shards > len(files):
        raise DataError(
            f"data.shards={shards} but the source has {len(files)} file(s); a file is one shard's unit "
            f"of work: lower data.shards or split the corpus into more files"
        )
    return [files[i::shards] for i in range(shards)]


def check_line_lengths(path: Path, what: str, max_doc_bytes: int) -> None:
    """Refuse a text file with a line longer than data.max_doc_bytes, in a streaming pass,
    before `datasets` would hold that whole line in memory."""
    if path.suffix == ".parquet":
        return
    current = ended = 0  # bytes of the line being read; lines ended before it
    try:
        with open(path, "rb") as fh:
            while chunk := fh.read(1 << 20):
                parts = chunk.split(b"\n")
                current += len(parts[0])
                lengths = {0: current}  # this chunk's lines by index (line ended + 1 + index): bytes
                if len(parts) > 1:
                    if len(chunk) > max_doc_bytes:  # only then can a line within the chunk be too long
                        lengths.update((i, len(p)) for i, p in enumerate(parts[1:-1], 1))
                    current = lengths[len(parts) - 1] = len(parts[-1])
                too_long = next((i for i, n in lengths.items() if n > max_doc_bytes), None)
                if too_long is not None:
                    raise DataError(
                        f"data.paths: {what} has a line longer than data.max_doc_bytes="
                        f"{max_doc_bytes} (line {ended + too_long + 1}); split it into documents or raise the limit"
                    )
                ended += len(parts) - 1
    except OSError as e:
        raise DataError(f"data.paths: cannot read {what}: {e.strerror}") from None


def local_copies(files: list[SourceFile], objects, scratch: Path) -> list[Path]:
    """Local paths of the files: local ones as they are, objects downloaded (verified) into scratch."""
    from components.store import SourceObject, parse_s3_url

    out = []
    for i, f in enumerate(files):
        if not f.is_object:
            out.append(Path(f.uri))
            continue
        dest = scratch / str(i) / f.relpath
        dest.parent.mkdir(parents=True, exist_ok=True)
        bucket, key = parse_s3_url(f.uri)
        objects.download(SourceObject(f.uri, bucket, key, f.relpath, f.size, f.digest), dest)
        out.append(dest)
    return out
