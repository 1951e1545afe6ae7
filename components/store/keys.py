"""The store's key and manifest model: key parts, errors, Ref, Manifest, hashing, time stamps, code version.

Keys are `<kind>/<name>/<version>/<file>`; a version's `manifest.json` lists its files with
sha256 and size, its metadata, parents, code version and created time.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

MANIFEST = "manifest.json"
# beside a version's files: its manifest moved aside with why and when (a quarantined version does
# not exist until it is committed again), and a pin (retention never deletes a pinned version)
QUARANTINED = "manifest.quarantined.json"
PINNED = "manifest.pinned.json"
RESERVED = (MANIFEST, QUARANTINED, PINNED)  # file names no artifact may have at its top level
LEASES = "_leases"  # top-level prefix of the leases (lease.py); store-internal prefixes start with "_"
# what the stages publish: tokenize (the dataset, its per-shard token blocks, the tokenizer trained
# once before a fanned-out tokenization), train (checkpoints, the model, the run's record, on-demand profiles),
# preflight, evaluate
KINDS = ("dataset", "shard", "tokenizer", "checkpoint", "model", "run", "preflight", "eval", "profile")
_PART = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+=-]{0,199}$")


class StoreError(RuntimeError):
    """Base for every store failure."""


class InvalidKey(StoreError, ValueError):
    pass


class NotFound(StoreError, LookupError):
    pass


class IntegrityError(StoreError):
    pass


class StoreUnreachable(StoreError):
    pass


def check_part(part: str, what: str) -> str:
    if not isinstance(part, str) or not _PART.match(part) or part in (".", ".."):
        raise InvalidKey(f"invalid {what} {part!r}: use letters, digits and . _ - + = (no '/', no '..')")
    return part


def check_relpath(path: str) -> str:
    """A file path inside a version: relative, no empty, '.' or '..' parts."""
    if not path or path.startswith("/") or "\\" in path or "\0" in path:
        raise InvalidKey(f"invalid file path {path!r} in artifact: must be relative")
    for part in path.split("/"):
        if part in ("", ".", ".."):
            raise InvalidKey(f"invalid file path {path!r} in artifact: empty, '.' or '..' part")
    return path


def check_range(offset: int, length: int) -> None:
    if not (isinstance(offset, int) and isinstance(length, int)) or offset < 0 or length < 0:
        raise ValueError(f"invalid byte range offset={offset!r} length={length!r}: both must be integers >= 0")


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def utc_now() -> str:
    """The store's time stamp (a manifest's created time, a quarantine's or a pin's): UTC, to the microsecond."""
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


def code_version() -> str:
    """The code that produced an artifact: $LIFTOFF_CODE_VERSION (images), else git."""
    if v := os.environ.get("LIFTOFF_CODE_VERSION"):
        return v
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, cwd=Path(__file__).resolve().parent
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).resolve().parent,
        )
        if out.returncode == 0:
            return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


@dataclass(frozen=True)
class Ref:
    kind: str
    name: str
    version: str

    def __post_init__(self) -> None:
        check_part(self.kind, "kind")
        check_part(self.name, "name")
        check_part(self.version, "version")

    @property
    def prefix(self) -> str:
        return f"{self.kind}/{self.name}/{self.version}"

    def __str__(self) -> str:
        return f"{self.kind}/{self.name}@{self.version}"

    @classmethod
    def parse(cls, text: str) -> Ref:
        """`KIND/NAME@VERSION` or `KIND/NAME/VERSION`."""
        parts = text.replace("@", "/").split("/")
        if len(parts) != 3:
            raise InvalidKey(f"invalid artifact reference {text!r}: expected KIND/NAME@VERSION")
        return cls(*parts)


@dataclass
class Manifest:
    ref: Ref
    files: dict[str, dict]  # relpath -> {"sha256", "size"}
    metadata: dict = field(default_factory=dict)
    parents: list[str] = field(default_factory=list)
    code_version: str = "unknown"
    created: str = ""

    def to_json(self) -> str:
        return json.dumps(
            {
                "kind": self.ref.kind,
                "name": self.ref.name,
                "version": self.ref.version,
                "files": self.files,
                "metadata": self.metadata,
                "parents": self.parents,
                "code_version": self.code_version,
                "created": self.created,
            },
            indent=2,
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, ref: Ref, raw: bytes) -> Manifest:
        """Parse and check a manifest; raise IntegrityError when it is not valid for ref."""
        try:
            d = json.loads(raw)
            if (d["kind"], d["name"], d["version"]) != (ref.kind, ref.name, ref.version):
                raise ValueError("names another version")
            files = d["files"]
            for path, entry in files.items():
                check_relpath(path)
                if not (isinstance(entry["sha256"], str) and len(entry["sha256"]) == 64 and entry["size"] >= 0):
                    raise ValueError(f"bad entry for {path}")
            return cls(ref, files, d["metadata"], list(d["parents"]), d["code_version"], d["created"])
        except (ValueError, KeyError, TypeError, InvalidKey) as e:
            raise IntegrityError(f"invalid manifest {ref.prefix}/{MANIFEST}: {e}") from None
