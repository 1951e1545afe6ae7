"""The checkpoint format, shared by the stages that write and read it (train, validate).

A finished checkpoint is a directory `step-N/`: DCP shards of model and optimizer, one
`rank{r}.pt` per rank (RNG states, tensors only), `meta.json`, and `checkpoint.json` (the
index) with the sha256 and size of every other file. `verify` is the only way in: every
file matches its recorded hash, every path stays inside the directory, and the DCP
`.metadata` pickle names nothing but the allowlisted classes.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader

from components.store import InvalidKey, check_relpath, sha256_file

INDEX = "checkpoint.json"


class CheckpointError(RuntimeError):
    pass


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_index(ckpt: Path, meta: dict) -> None:
    files = {}
    for p in sorted(ckpt.rglob("*")):
        if p.is_file() and p.name != INDEX:
            with open(p, "rb") as f:
                os.fsync(f.fileno())
            files[p.relative_to(ckpt).as_posix()] = {"sha256": sha256_file(p), "size": p.stat().st_size}
    index = ckpt / INDEX
    with open(index, "w") as f:
        json.dump({"files": files, "meta": meta}, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(ckpt)


def verify(ckpt: Path) -> dict:
    """The checkpoint's meta when every file matches its recorded sha256 and size, every path in
    its index stays inside it, and its DCP metadata unpickles with the allowlist."""
    index = ckpt / INDEX
    if not index.is_file():
        raise CheckpointError(f"{ckpt}: no {INDEX} (incomplete save)")
    try:
        recorded = json.loads(index.read_text())
        files, meta = recorded["files"], recorded["meta"]
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"{index}: unreadable ({e})") from None
    for rel, entry in files.items():
        try:
            p = ckpt / check_relpath(rel)
        except InvalidKey as e:
            raise CheckpointError(f"{index}: {e}") from None
        if not p.is_file():
            raise CheckpointError(f"{p}: missing")
        if p.stat().st_size != entry["size"]:
            raise CheckpointError(f"{p}: size {p.stat().st_size} != recorded {entry['size']} (truncated?)")
        if sha256_file(p) != entry["sha256"]:
            raise CheckpointError(f"{p}: sha256 mismatch")
    if (ckpt / ".metadata").is_file():  # hashes prove integrity, not intent: refuse code before DCP sees it
        read_metadata_safely(ckpt / ".metadata")
    return meta


def version_of(identity: str, ckpt: Path) -> str:
    """The store version of a finished checkpoint: its training identity, step and a digest of
    its index (which holds every file's sha256), so different content never shares a version."""
    return f"{identity}-step{step_of(ckpt)}-{sha256_file(ckpt / INDEX)[:12]}"


def step_of(path: Path) -> int:
    return int(path.name.split("-", 1)[1])


def local_checkpoints(root: Path) -> list[Path]:
    """Finished (renamed) checkpoint dirs, newest first."""
    if not root.is_dir():
        return []
    done = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-") and p.name[5:].isdigit()]
    return sorted(done, key=step_of, reverse=True)


# The only globals a DCP `.metadata` pickle may name, as exact (module, qualified name) pairs
# (read off the checkpoints DDP and FSDP runs write). No dotted names: pickle resolves
# "os.system" attribute by attribute through any module that imports os.
ALLOWED_GLOBALS = frozenset(
    {("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING",
    )}
    | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("collections", "OrderedDict"),
    }
)  # fmt: skip


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's `.metadata` is a pickle: resolve only the allowed globals and torch dtypes."""

    def find_class(self, module: str, name: str):
        dtype = module == "torch" and "." not in name and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in ALLOWED_GLOBALS or dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to unpickle {module}.{name}")


def read_metadata_safely(path: Path):
    """The DCP metadata in `path`, or CheckpointError naming the file."""
    try:
        with open(path, "rb") as f:
            return _MetadataUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as e:
        raise CheckpointError(
            f"{path}: refusing to load checkpoint metadata ({e}); it may reference only DCP's own classes"
        ) from None


class SafeFileSystemReader(FileSystemReader):
    def read_metadata(self, *args, **kwargs):
        metadata = read_metadata_safely(Path(self._get_metadata_path(kwargs.get("rank"))))
        return _finish_metadata(metadata, self)


def _finish_metadata(metadata, reader):
    from torch.distributed.checkpoint.metadata import StorageMeta

    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = reader.load_id
    return metadata
