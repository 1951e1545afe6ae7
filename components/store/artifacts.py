"""The versioned artifact store: a local directory or MinIO, one layout and one interface.

Keys are `<kind>/<name>/<version>/<file>`. A version is published file by file and its
`manifest.json` (files with sha256 and size, metadata, parents, code version, created
time) is written last: a version without a valid manifest does not exist, so a publish
that dies half-way leaves nothing visible. Fetches verify every file's sha256.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Protocol, TypeVar

from components.config import StoreBackend, StoreConfig

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
# what the stages publish: tokenize, train (checkpoints, the model, the run's record), preflight, evaluate
KINDS = ("dataset", "checkpoint", "model", "run", "preflight", "eval")
_PART = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+=-]{0,199}$")
T = TypeVar("T")


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


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


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


class Backend(Protocol):
    """Flat object storage: the only thing the two backends differ in."""

    description: str

    def put_file(self, key: str, path: Path) -> None: ...
    def put_bytes(self, key: str, data: bytes) -> None: ...
    def get_bytes(self, key: str) -> bytes: ...  # NotFound when absent
    def get_file(self, key: str, dest: Path) -> None: ...
    def list_prefixes(self, prefix: str) -> list[str]: ...  # direct children "dirs" of prefix
    def list_manifests(self, prefix: str) -> dict[str, float]: ...  # version -> manifest mtime, one listing
    def list_sizes(self, prefix: str) -> dict[str, int]: ...  # path under prefix -> size, every object
    def delete(self, key: str) -> None: ...


class LocalBackend:
    """A directory tree; each object is written to a temp file and renamed into place."""

    def __init__(self, root: Path):
        self.root = Path(root).resolve()
        self.description = f"local directory {self.root}"

    def _path(self, key: str) -> Path:
        if "\0" in key:
            raise InvalidKey(f"key {key!r} contains a NUL byte")
        check_relpath(key)
        p = (self.root / key).resolve()
        if self.root not in p.parents:
            raise InvalidKey(f"key {key!r} escapes the store root {self.root}")
        return p

    def _atomic_write(self, key: str, write: Callable[[Path], None]) -> None:
        dest = self._path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".tmp-")
        os.close(fd)
        try:
            write(Path(tmp))
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, dest)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def put_file(self, key: str, path: Path) -> None:
        self._atomic_write(key, lambda tmp: shutil.copyfile(path, tmp))

    def put_bytes(self, key: str, data: bytes) -> None:
        self._atomic_write(key, lambda tmp: tmp.write_bytes(data))

    def get_bytes(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise NotFound(f"{key} not found in {self.description}") from None

    def get_file(self, key: str, dest: Path) -> None:
        src = self._path(key)
        if not src.is_file():
            raise NotFound(f"{key} not found in {self.description}")
        shutil.copyfile(src, dest)

    def list_prefixes(self, prefix: str) -> list[str]:
        d = self._path(prefix) if prefix else self.root
        if not d.is_dir():
            return []
        return sorted(p.name for p in d.iterdir() if p.is_dir() and not p.name.startswith("."))

    def list_manifests(self, prefix: str) -> dict[str, float]:
        d = self._path(prefix)
        if not d.is_dir():
            return {}
        found = {}
        for version in d.iterdir():
            try:
                found[version.name] = (version / MANIFEST).stat().st_mtime
            except (FileNotFoundError, NotADirectoryError):
                continue
        return found

    def list_sizes(self, prefix: str) -> dict[str, int]:
        d = self._path(prefix)
        if not d.is_dir():
            return {}
        return {
            p.relative_to(d).as_posix(): p.stat().st_size
            for p in d.rglob("*")
            if p.is_file() and not p.name.startswith(".tmp-")
        }

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)


class MinioBackend:
    """MinIO / S3 through the `minio` SDK, with bounded retries on transient errors."""

    def __init__(
        self,
        endpoint: str,
        bucket: str,
        prefix: str,
        secure: bool,
        timeout_s: float,
        access_key: str | None,
        secret_key: str | None,
    ):
        import urllib3
        from minio import Minio

        self.endpoint, self.bucket, self.timeout_s = endpoint, bucket, timeout_s
        self.prefix = prefix.strip("/")
        self.description = f"MinIO endpoint {endpoint} bucket {bucket}"
        # No retries inside urllib3: _retry below owns the schedule and its total time.
        http = urllib3.PoolManager(
            timeout=urllib3.Timeout(connect=min(5.0, timeout_s), read=60.0), retries=False, maxsize=32
        )
        self.client = Minio(endpoint, access_key=access_key, secret_key=secret_key, secure=secure, http_client=http)
        self._retry(self._ensure_bucket, "prepare bucket")

    def _ensure_bucket(self) -> None:
        from minio.commonconfig import ENABLED
        from minio.error import S3Error
        from minio.versioningconfig import VersioningConfig

        try:
            self.client.make_bucket(self.bucket)
        except S3Error as e:
            if e.code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise
        if self.client.get_bucket_versioning(self.bucket).status != ENABLED:
            self.client.set_bucket_versioning(self.bucket, VersioningConfig(ENABLED))

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _retry(self, op: Callable[[], T], what: str) -> T:
        import urllib3
        from minio.error import S3Error, ServerError

        start, attempt, delay = time.monotonic(), 0, 0.2
        while True:
            attempt += 1
            try:
                return op()
            except S3Error as e:
                if e.code in ("NoSuchKey", "NoSuchBucket"):
                    raise NotFound(f"{what}: {e.code} at {self.description}") from None
                if e.code not in ("SlowDown", "InternalError", "ServiceUnavailable", "RequestTimeout"):
                    raise StoreError(f"{what} failed at {self.description}: {e.code}: {e.message}") from None
                err: Exception = e
            except (ServerError, urllib3.exceptions.HTTPError, ConnectionError, TimeoutError) as e:
                err = e
            elapsed = time.monotonic() - start
            if elapsed + delay > self.timeout_s:
                raise StoreUnreachable(
                    f"artifact store at {self.endpoint} unreachable: {what} failed {attempt} times in "
                    f"{elapsed:.1f}s (store.timeout_s={self.timeout_s}); last error: {type(err).__name__}"
                ) from None
            log.warning(
                "store %s: %s failed (%s), retry %d in %.1fs", self.endpoint, what, type(err).__name__, attempt, delay
            )
            time.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, 5.0)

    def put_file(self, key: str, path: Path) -> None:
        self._retry(lambda: self.client.fput_object(self.bucket, self._key(key), str(path)), f"put {key}")

    def put_bytes(self, key: str, data: bytes) -> None:
        import io

        self._retry(
            lambda: self.client.put_object(self.bucket, self._key(key), io.BytesIO(data), len(data)), f"put {key}"
        )

    def get_bytes(self, key: str) -> bytes:
        def op() -> bytes:
            resp = self.client.get_object(self.bucket, self._key(key))
            try:
                return resp.read()
            finally:
                resp.close()
                resp.release_conn()

        return self._retry(op, f"get {key}")

    def get_file(self, key: str, dest: Path) -> None:
        self._retry(lambda: self.client.fget_object(self.bucket, self._key(key), str(dest)), f"get {key}")

    def list_prefixes(self, prefix: str) -> list[str]:
        full = self._key(prefix) + "/" if prefix else (self.prefix + "/" if self.prefix else "")

        def op() -> list[str]:
            names = []
            for obj in self.client.list_objects(self.bucket, prefix=full, recursive=False):
                if obj.is_dir:
                    names.append(obj.object_name[len(full) :].rstrip("/"))
            return sorted(names)

        return self._retry(op, f"list {prefix or '/'}")

    def list_manifests(self, prefix: str) -> dict[str, float]:
        full = self._key(prefix) + "/"

        def op() -> dict[str, float]:
            found = {}
            for obj in self.client.list_objects(self.bucket, prefix=full, recursive=True):
                version, _, rest = obj.object_name[len(full) :].partition("/")
                if rest == MANIFEST:
                    found[version] = obj.last_modified.timestamp()
            return found

        return self._retry(op, f"list {prefix}")

    def list_sizes(self, prefix: str) -> dict[str, int]:
        full = self._key(prefix) + "/"

        def op() -> dict[str, int]:
            objects = self.client.list_objects(self.bucket, prefix=full, recursive=True)
            return {obj.object_name[len(full) :]: obj.size for obj in objects}

        return self._retry(op, f"list {prefix}")

    def delete(self, key: str) -> None:
        self._retry(lambda: self.client.remove_object(self.bucket, self._key(key)), f"delete {key}")


def _files_of(src: Path) -> dict[str, Path]:
    src = Path(src)
    if src.is_file():
        return {src.name: src}
    if not src.is_dir():
        raise NotFound(f"nothing to publish at {src}")
    files = {p.relative_to(src).as_posix(): p for p in sorted(src.rglob("*")) if p.is_file()}
    for rel in files:
        check_relpath(rel)
    return files


class ArtifactStore:
    def __init__(self, backend: Backend, cache_dir: Path):
        self.backend = backend
        self.cache_dir = Path(cache_dir)

    @property
    def description(self) -> str:
        return self.backend.description

    def manifest(self, ref: Ref) -> Manifest:
        """The valid manifest of ref; NotFound when the version does not exist."""
        raw = self.backend.get_bytes(f"{ref.prefix}/{MANIFEST}")
        return Manifest.from_json(ref, raw)

    def exists(self, ref: Ref) -> bool:
        try:
            self.manifest(ref)
            return True
        except NotFound:
            return False
        except IntegrityError as e:
            log.warning("ignoring %s: %s", ref, e)
            return False

    def publish(
        self,
        kind: str,
        name: str,
        version: str,
        src: Path,
        metadata: dict | None = None,
        parents: list[str] | tuple[str, ...] = (),
        same_content: bool = False,
    ) -> Manifest:
        """Upload a file or directory as kind/name@version; the manifest goes last.

        A version that already exists is immutable: publishing it again returns the
        stored manifest untouched. With `same_content` (versions named by their content) it
        must also hold the same bytes: otherwise IntegrityError names both.
        """
        ref = Ref(kind, name, version)
        files = _files_of(src)
        if self.exists(ref):
            ours = {rel: {"sha256": sha256_file(path)} for rel, path in files.items()} if same_content else None
            return self._stored(ref, ours, str(src))
        if MANIFEST in files:
            raise InvalidKey(f"{src} contains a file named {MANIFEST}, which the store reserves")
        return self.commit(ref, self.upload(ref, files), metadata, parents)

    def _stored(self, ref: Ref, ours: dict | None, what: str) -> Manifest:
        """The stored manifest of an existing version; with `ours`, it must hold those bytes."""
        stored = self.manifest(ref)
        if ours is not None:
            theirs = {rel: entry["sha256"] for rel, entry in stored.files.items()}
            mine = {rel: entry["sha256"] for rel, entry in ours.items()}
            if mine != theirs:
                differ = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
                raise IntegrityError(
                    f"{ref} already exists in {self.description} with other content than {what} "
                    f"(differing files: {', '.join(differ[:5])}); refusing to keep either silently"
                )
        log.info("%s already in the store; not published again", ref)
        return stored

    def upload(self, ref: Ref, files: dict[str, Path]) -> dict[str, dict]:
        """Upload files into a version that is not visible yet; their manifest entries. Several
        processes may each upload their share of one version (the ranks of a checkpoint)."""
        entries = {}
        for rel, path in files.items():
            check_relpath(rel)
            entries[rel] = {"sha256": sha256_file(path), "size": path.stat().st_size}
            self.backend.put_file(f"{ref.prefix}/{rel}", path)
        return entries

    def commit(
        self,
        ref: Ref,
        entries: dict[str, dict],
        metadata: dict | None = None,
        parents: list[str] | tuple[str, ...] = (),
        same_content: bool = False,
    ) -> Manifest:
        """Make a version visible: write its manifest, once every listed file is in the store at
        its recorded size (one listing). A missing part is an error naming it; nothing is written."""
        for p in parents:
            Ref.parse(p)
        if self.exists(ref):
            return self._stored(ref, entries if same_content else None, "the files to commit")
        present = self.backend.list_sizes(ref.prefix)
        missing = sorted(rel for rel, e in entries.items() if present.get(check_relpath(rel)) != e["size"])
        if missing:
            raise IntegrityError(
                f"{ref}: {len(missing)} file(s) not in {self.description} at their recorded size "
                f"({', '.join(missing[:5])}); not publishing it"
            )
        manifest = Manifest(
            ref,
            dict(entries),
            dict(metadata or {}),
            list(parents),
            code_version(),
            datetime.now(timezone.utc).isoformat(timespec="microseconds"),
        )
        self.backend.put_bytes(f"{ref.prefix}/{MANIFEST}", manifest.to_json().encode())
        log.info("published %s (%d files) to %s", ref, len(entries), self.description)
        return manifest

    def versions(self, kind: str, name: str) -> list[Manifest]:
        """Every valid version of kind/name, oldest first."""
        check_part(kind, "kind")
        check_part(name, "name")
        found = []
        for version in self.backend.list_prefixes(f"{kind}/{name}"):
            try:
                found.append(self.manifest(Ref(kind, name, version)))
            except (NotFound, IntegrityError, InvalidKey):
                continue  # a partial or foreign version is invisible
        return sorted(found, key=lambda m: (m.created, m.ref.version))

    def resolve(self, kind: str, name: str, version: str = "latest") -> Manifest:
        if version != "latest":
            try:
                return self.manifest(Ref(kind, name, version))
            except NotFound:
                raise NotFound(f"no version {kind}/{name}@{version} in {self.description}") from None
        return self._latest(kind, name)

    def _latest(self, kind: str, name: str) -> Manifest:
        """The newest valid version from one listing: manifests are read only for the versions
        written in the newest second (object stores time-stamp to the second), newest first."""
        check_part(kind, "kind")
        check_part(name, "name")
        stamps = self.backend.list_manifests(f"{kind}/{name}")
        while stamps:
            newest = max(stamps.values())
            recent = [v for v, t in stamps.items() if t >= newest - 1.0]
            valid = []
            for version in recent:
                del stamps[version]
                try:
                    valid.append(self.manifest(Ref(kind, name, version)))
                except (NotFound, IntegrityError, InvalidKey):
                    continue
            if valid:
                return max(valid, key=lambda m: (m.created, m.ref.version))
        raise NotFound(f"no version of {kind}/{name} in {self.description}")

    def ls(self, kind: str | None = None) -> Iterator[Manifest]:
        kinds = [kind] if kind else self.backend.list_prefixes("")
        for k in kinds:
            check_part(k, "kind")
            for name in self.backend.list_prefixes(k):
                yield from self.versions(k, name)

    def fetch(self, ref: Ref | Manifest, dest: Path | None = None) -> Path:
        """Download a version into the cache (or dest), verifying every sha256."""
        manifest = ref if isinstance(ref, Manifest) else self.manifest(ref)
        ref = manifest.ref
        dest = Path(dest) if dest else self.cache_dir / ref.kind / ref.name / ref.version
        stamp = dest / ".liftoff-verified"
        digest = hashlib.sha256(manifest.to_json().encode()).hexdigest()
        if stamp.is_file() and stamp.read_text() == digest:
            return dest
        dest.mkdir(parents=True, exist_ok=True)
        for rel, entry in manifest.files.items():
            key = f"{ref.prefix}/{rel}"
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            if not (
                target.is_file() and target.stat().st_size == entry["size"] and sha256_file(target) == entry["sha256"]
            ):
                tmp = target.with_name(f".{target.name}.{os.getpid()}.part")  # ranks of one node may fetch at once
                self.backend.get_file(key, tmp)
                got = sha256_file(tmp)
                if got != entry["sha256"]:
                    tmp.unlink(missing_ok=True)
                    raise IntegrityError(
                        f"sha256 mismatch for {key} in {self.description}: "
                        f"manifest says {entry['sha256'][:12]}, object is {got[:12]}"
                    )
                os.replace(tmp, target)
        stamp.write_text(digest)
        return dest

    def lineage(self, ref: Ref) -> dict:
        """The version and, recursively, the versions it was made from."""
        m = self.manifest(ref)
        parents = []
        for p in m.parents:
            try:
                parents.append(self.lineage(Ref.parse(p)))
            except NotFound:
                parents.append({"ref": p, "missing": True, "parents": []})
        return {"ref": str(m.ref), "created": m.created, "code_version": m.code_version, "parents": parents}


def open_store(cfg: StoreConfig) -> ArtifactStore:
    """The store the config names; MinIO keys come only from the environment."""
    if cfg.backend == StoreBackend.local:
        return ArtifactStore(LocalBackend(Path(cfg.root)), Path(cfg.cache_dir))
    endpoint = cfg.endpoint or os.environ.get("MINIO_ENDPOINT")
    if not endpoint:
        raise StoreError("store.backend=minio needs store.endpoint or $MINIO_ENDPOINT")
    secure = (
        cfg.secure
        if cfg.secure is not None
        else os.environ.get("MINIO_SECURE", "false").lower() in ("1", "true", "yes")
    )
    backend = MinioBackend(
        endpoint,
        cfg.bucket,
        cfg.root,
        secure,
        cfg.timeout_s,
        os.environ.get("MINIO_ACCESS_KEY"),
        os.environ.get("MINIO_SECRET_KEY"),
    )
    return ArtifactStore(backend, Path(cfg.cache_dir))
