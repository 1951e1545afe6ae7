"""The checkpoint format, shared by the stages that write and read it (train, validate).

A finished checkpoint is a directory `step-N/`: DCP shards of model and optimizer, one
`rank{r}.pt` per rank (RNG states, tensors only), `meta.json`, and `checkpoint.json` (the
index) with the sha256 and size of every other file. Each rank writes its own files on its
own node (`own_files`); the index lists every rank's, so a node's directory is complete only
once the checkpoint is fetched back from the store, where the ranks' parts are joined.
`verify` is the only way in: every file matches its recorded hash, every path stays inside
the directory, and the DCP `.metadata` pickle names nothing but the allowlisted classes.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import queue
import re
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from components.store import InvalidKey, check_relpath, sha256_file

INDEX = "checkpoint.json"
HISTORY = "history.jsonl"  # the run's metrics.jsonl as of the checkpoint: a fresh pod's curves start at step 1
SHARD_SUFFIX = ".distcp"  # DCP's data files; everything else in a checkpoint is small
MODEL_KEY = "model"  # the saved state is {"model": weights, "optim": optimizer state}, flattened by DCP


class CheckpointError(RuntimeError):
    pass


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def own_files(ckpt: Path, rank: int) -> list[str]:
    """The files of a checkpoint that `rank` wrote: its DCP shards (`__<rank>_<i>.distcp`, DCP's
    naming), its RNG state, and on rank 0 DCP's `.metadata`, `meta.json` and the run's history."""
    names = [p.name for p in ckpt.glob(f"__{rank}_*.distcp")] + [f"rank{rank}.pt"]
    if rank == 0:
        names += [".metadata", "meta.json", HISTORY]
    return sorted(n for n in names if (ckpt / n).is_file())


def file_entries(ckpt: Path, names: list[str], block_bytes: int | None = None) -> dict[str, dict]:
    """sha256 and size of each file, fsynced first: what the index records. With `block_bytes`,
    a DCP shard file also records the sha256 of each block of that many bytes (the last one
    shorter), so a rank that reads part of it can fetch and verify only the blocks it reads."""
    entries = {}
    for name in names:
        path = ckpt / name
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        if block_bytes and name.endswith(SHARD_SUFFIX):
            whole, blocks = block_digests(path, block_bytes)
            entries[name] = {"sha256": whole, "size": path.stat().st_size, "block_bytes": block_bytes, "blocks": blocks}
        else:
            entries[name] = {"sha256": sha256_file(path), "size": path.stat().st_size}
    return entries


def block_digests(path: Path, block_bytes: int, piece: int = 1 << 20) -> tuple[str, list[str]]:
    """The file's sha256 and the sha256 of each `block_bytes` block, in one read."""
    whole, blocks = hashlib.sha256(), []
    with open(path, "rb") as f:
        while True:
            block, left = hashlib.sha256(), block_bytes
            while left and (data := f.read(min(piece, left))):
                whole.update(data)
                block.update(data)
                left -= len(data)
            if left == block_bytes:
                return whole.hexdigest(), blocks
            blocks.append(block.hexdigest())
            if left:
                return whole.hexdigest(), blocks


def index_bytes(files: dict[str, dict], meta: dict) -> bytes:
    return json.dumps({"files": dict(sorted(files.items())), "meta": meta}, indent=2).encode()


def write_index(ckpt: Path, data: bytes) -> None:
    with open(ckpt / INDEX, "wb") as f:
        f.write(data)
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
    """The DCP metadata in `path`, or CheckpointError naming the file: it must unpickle with the
    allowlist into DCP's Metadata, and every shard file it names must be a plain relative path."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise TypeError(f"holds a {type(metadata).__name__}, not DCP's Metadata")
        for info in (metadata.storage_data or {}).values():
            check_relpath(info.relative_path)
            if "/" in info.relative_path:
                raise InvalidKey(f"shard path {info.relative_path!r} leaves the checkpoint directory")
    except Exception as e:  # whatever a crafted pickle raises, it is refused with the file named
        raise CheckpointError(
            f"{path}: refusing to load checkpoint metadata ({e}); it may reference only DCP's own classes"
        ) from None
    return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP stores non-tensor state (optimizer param groups) as pickled bytes and loads them with
    `torch.load(weights_only=False)`, which runs any code a crafted shard holds: load them as
    plain data only."""

    def load_bytes(self, read_item, value) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except Exception as e:
            raise CheckpointError(f"refusing to load {read_item.dest_index.fqn} from the checkpoint ({e})") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


class ClusteredWriter(FileSystemWriter):
    """DCP's FileSystemWriter, each rank's items in two files laid out for partial reads: the
    model's (`__<rank>_0.distcp`) and the optimizer's (`__<rank>_1.distcp`), so a reader of the
    weights alone (validate) fetches no optimizer byte. Within a file, the
    byte items come first (DCP writes them first), then the whole tensors smallest first, then
    the shards: what a rank of another layout reads from a file it mostly does not need (the
    replicated items DCP saved once, on whichever rank: param groups, Adam's step counts) sits
    in its first blocks, so a partial fetch costs a block or two, not one per scattered scalar.
    (On a GPU, DCP's overlapping loader writes a file's tensors smallest first instead, which
    keeps those small shared items at the front too.)"""

    def write_data(self, plan, planner):
        files: queue.Queue = queue.Queue()
        for number, part in enumerate(_by_file(plan.items)):
            if part:
                name = f"{plan.storage_data.prefix}{number}{SHARD_SUFFIX}"
                files.put((self.fs.concat_path(self.path, name), name, sorted(part, key=_shared_first)))
        return self._write_data(planner, files)


def _by_file(items) -> tuple[list, list]:
    weights = [i for i in items if i.index.fqn.startswith(f"{MODEL_KEY}.")]
    return weights, [i for i in items if not i.index.fqn.startswith(f"{MODEL_KEY}.")]


def _shared_first(item) -> tuple[int, int]:
    data = item.tensor_data
    if data is None:  # a byte item
        return (0, 0)
    whole = tuple(data.chunk.sizes) == tuple(data.size)
    return (1, data.chunk.sizes.numel()) if whole else (2, 0)


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


def load_state(state: dict, ckpt: Path, no_dist: bool = False) -> None:
    """DCP load of a verified checkpoint into `state`, in place, unpickling nothing arbitrary."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(str(ckpt)), planner=SafeLoadPlanner(), no_dist=no_dist)
    except CheckpointException as e:  # DCP wraps every rank's error (and derives from BaseException)
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        errors = [ln for ln in lines if re.match(r"^[\w.]*(Error|Exception): ", ln)]  # the ranks' own errors
        cause = (errors or lines or [type(e).__name__])[-1]
        raise CheckpointError(f"{ckpt}: {cause}") from None
