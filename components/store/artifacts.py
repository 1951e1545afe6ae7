"""The versioned artifact store: a local directory or MinIO, one layout and one interface.

Keys are `<kind>/<name>/<version>/<file>`. A version is published file by file and its
`manifest.json` (files with sha256 and size, metadata, parents, code version, created
time) is written last: a version without a valid manifest does not exist, so a publish
that dies half-way leaves nothing visible. Fetches verify every file's sha256.

A version whose stored bytes do not verify is quarantined (`quarantine`): its manifest is moved
aside to `<kind>/<name>/<version>/manifest.quarantined.json` with the reason and time, so the
version no longer exists for `exists`, `manifest`, `versions`, `resolve` and `ls` (it is never
resumed and never a parent) while its bytes stay for forensics; committing the version again
(a rerun that produces the same content-named version) makes it valid again. A pin
(`manifest.pinned.json`) keeps a version from retention. `delete` removes a version: the
manifest first (a half-deleted version is invisible), then every object and, on a versioned
bucket, every object version under its prefix.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Protocol

from components.config import StoreBackend, StoreConfig
from components.store.damage import Damage
from components.store.deletion import Deletion
from components.store.keys import (
    MANIFEST,
    QUARANTINED,
    RESERVED,
    IntegrityError,
    InvalidKey,
    Manifest,
    NotFound,
    Ref,
    check_part,
    check_range,
    check_relpath,
    code_version,
    sha256_file,
    utc_now,
)
from components.store.local import LocalBackend
from components.store.s3 import MinioBackend

log = logging.getLogger(__name__)


class Backend(Protocol):
    """Flat object storage: the only thing the two backends differ in."""

    description: str

    def put_file(self, key: str, path: Path) -> None: ...
    def put_bytes(self, key: str, data: bytes) -> None: ...
    def get_bytes(self, key: str) -> bytes: ...  # NotFound when absent
    def get_range(self, key: str, offset: int, length: int) -> bytes: ...  # clamped at the end; NotFound
    def get_file(self, key: str, dest: Path) -> None: ...
    def list_prefixes(self, prefix: str) -> list[str]: ...  # direct children "dirs" of prefix
    def list_manifests(self, prefix: str) -> dict[str, float]: ...  # version -> manifest mtime, one listing
    def list_sizes(self, prefix: str) -> dict[str, int]: ...  # path under prefix -> size, every object
    def delete(self, key: str) -> None: ...
    def digest(self, key: str) -> tuple[str, int]: ...  # (sha256 hex, size), streamed; NotFound
    def put_bytes_if_absent(self, key: str, data: bytes) -> bool: ...  # atomic create; False if present
    def replace_bytes_if(self, key: str, expected: bytes, data: bytes) -> bool: ...  # compare-and-swap
    def purge(self, prefix: str) -> int: ...  # the object or everything under prefix/, every version
    def drop_history(self, key: str) -> int: ...  # the noncurrent versions of one object


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


def _check_not_reserved(entries: Iterable[str], what: str) -> None:
    reserved = sorted(set(entries) & set(RESERVED))
    if reserved:
        raise InvalidKey(f"{what} contains a file named {reserved[0]}, which the store reserves")


class ArtifactStore(Damage, Deletion):
    def __init__(self, backend: Backend, cache_dir: Path):
        self.backend = backend
        self.cache_dir = Path(cache_dir)
        self.config: StoreConfig | None = None  # set by open_store

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
        _check_not_reserved(files, str(src))
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
        _check_not_reserved(files, f"the files of {ref}")
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
        its recorded size (one listing). A missing part is an error naming it; nothing is written.

        A new version made from a quarantined parent is refused (IntegrityError naming it). Committing a quarantined
        version again makes it valid once every file's stored bytes verify against `entries`
        (streamed, each hashed); the quarantine record is then removed."""
        for p in parents:
            Ref.parse(p)
        if self.exists(ref):
            return self._stored(ref, entries if same_content else None, "the files to commit")
        for p in parents:
            parent = Ref.parse(p)
            if (record := self.quarantined(parent)) is not None:
                raise IntegrityError(
                    f"{ref}: parent {parent} is quarantined in {self.description} "
                    f"({record.get('reason', 'no reason recorded')}); not publishing a version made from it"
                )
        _check_not_reserved(entries, f"the files of {ref}")
        present = self.backend.list_sizes(ref.prefix)
        missing = sorted(rel for rel, e in entries.items() if present.get(check_relpath(rel)) != e["size"])
        if missing:
            raise IntegrityError(
                f"{ref}: {len(missing)} file(s) not in {self.description} at their recorded size "
                f"({', '.join(missing[:5])}); not publishing it"
            )
        manifest = Manifest(ref, dict(entries), dict(metadata or {}), list(parents), code_version(), utc_now())
        healing = self.quarantined(ref) is not None
        if healing and (problems := self.verify(manifest)):
            raise IntegrityError(
                f"{ref} stays quarantined: its stored bytes do not match the files to commit "
                f"({'; '.join(problems[:3])})"
            )
        self.backend.put_bytes(f"{ref.prefix}/{MANIFEST}", manifest.to_json().encode())
        if healing:
            self.backend.delete(f"{ref.prefix}/{QUARANTINED}")
            log.info("%s was quarantined; committed again with verified bytes, it is valid again", ref)
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
        kinds = [kind] if kind else [k for k in self.backend.list_prefixes("") if not k.startswith("_")]
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
        for rel in manifest.files:
            self.fetch_file(manifest, rel, dest / rel)
        stamp.write_text(digest)
        return dest

    def fetch_file(self, manifest: Manifest, rel: str, target: Path) -> Path:
        """One file of a version at `target`, verified against the manifest; kept when the
        file there already matches. Written under a per-process temp name, then renamed."""
        entry = manifest.files.get(rel)
        if entry is None:
            raise NotFound(f"{manifest.ref.prefix}/{rel} is not a file of {manifest.ref}")
        target = Path(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.is_file() and target.stat().st_size == entry["size"] and sha256_file(target) == entry["sha256"]:
            return target
        key = f"{manifest.ref.prefix}/{rel}"
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
        return target

    def read_range(self, manifest: Manifest, path: str, offset: int, length: int) -> bytes:
        """length bytes of one file of a version from offset, clamped to the file's size. A range
        cannot be checked against the file's sha256; its length is checked against the manifest."""
        key = f"{manifest.ref.prefix}/{path}"
        entry = manifest.files.get(path)
        if entry is None:
            raise NotFound(f"{key}: {manifest.ref} has no file {path!r} (in {self.description})")
        check_range(offset, length)
        want = max(0, min(length, entry["size"] - offset))
        data = self.backend.get_range(key, offset, want) if want else b""
        if len(data) != want:
            raise IntegrityError(
                f"{key} in {self.description}: {len(data)} bytes at offset {offset}, "
                f"the manifest's size {entry['size']} promises {want}"
            )
        return data

    def lineage(self, ref: Ref) -> dict:
        """The version and, recursively, the versions it was made from. A parent not in the store
        is `missing`; a quarantined one (or ref itself) is `quarantined`, with its reason and time."""
        try:
            m, node = self.manifest(ref), {}
        except NotFound:
            record = self.quarantined(ref)
            if record is None:
                raise
            node = {"quarantined": True, "reason": record.get("reason"), "quarantined_at": record.get("at")}
            if not record.get("manifest"):
                return {"ref": str(ref), **node, "parents": []}
            m = Manifest.from_json(ref, json.dumps(record["manifest"]).encode())
        parents = []
        for p in m.parents:
            try:
                parents.append(self.lineage(Ref.parse(p)))
            except NotFound:
                parents.append({"ref": p, "missing": True, "parents": []})
        return {"ref": str(m.ref), "created": m.created, "code_version": m.code_version, **node, "parents": parents}


def open_store(cfg: StoreConfig, create: bool = True) -> ArtifactStore:
    """The store the config names; MinIO keys come only from the environment. create=False (the
    `artifacts` commands): a store that does not exist is a StoreError naming store.root (or
    store.bucket) and the path, not an empty listing."""
    if cfg.backend == StoreBackend.local:
        store = ArtifactStore(LocalBackend(Path(cfg.root), create), Path(cfg.cache_dir))
    else:
        store = ArtifactStore(MinioBackend.from_config(cfg, create), Path(cfg.cache_dir))
    store.config = cfg  # what s3:// data sources connect with: the same endpoint and keys
    return store
