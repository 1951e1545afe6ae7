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
from datetime import datetime, timezone
from pathlib import Path
from typing import Protocol

from components.config import StoreBackend, StoreConfig
from components.store.keys import (
    MANIFEST,
    PINNED,
    QUARANTINED,
    RESERVED,
    IntegrityError,
    InvalidKey,
    Manifest,
    NotFound,
    Ref,
    StoreError,
    check_part,
    check_range,
    check_relpath,
    code_version,
    sha256_file,
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


class HasDependants(StoreError):
    """A version some other version's lineage names: removing it alone would break that lineage."""

    def __init__(self, ref: Ref, dependants: list[Ref]):
        self.ref, self.dependants = ref, dependants
        names = ", ".join(map(str, dependants))
        super().__init__(
            f"{ref} is in the lineage of {len(dependants)} version{'s' if len(dependants) != 1 else ''}: "
            f"{names}; --with-dependants removes them too"
        )


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


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


class ArtifactStore:
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
        manifest = Manifest(ref, dict(entries), dict(metadata or {}), list(parents), code_version(), _now())
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

    # -- damage: verify, quarantine ---------------------------------------------------------------

    def verify(self, ref: Ref | Manifest) -> list[str]:
        """Re-hash a version's stored objects against its manifest (each streamed; nothing is
        kept): one line per problem (missing, wrong size, wrong sha256); [] when it verifies."""
        manifest = ref if isinstance(ref, Manifest) else self.manifest(ref)
        prefix = manifest.ref.prefix
        present = self.backend.list_sizes(prefix)
        problems = []
        for rel, entry in sorted(manifest.files.items()):
            key = f"{prefix}/{rel}"
            if rel not in present:
                problems.append(f"{key}: missing")
            elif present[rel] != entry["size"]:
                problems.append(f"{key}: {present[rel]} bytes, the manifest says {entry['size']}")
            else:
                try:
                    got, size = self.backend.digest(key)
                except NotFound:
                    problems.append(f"{key}: missing")
                    continue
                if (got, size) != (entry["sha256"], entry["size"]):
                    problems.append(f"{key}: sha256 {got[:12]}, the manifest says {entry['sha256'][:12]}")
        return problems

    def quarantine(self, ref: Ref, reason: str) -> dict:
        """Take a version out of the store's view, keeping its bytes: its manifest moves to
        `<prefix>/manifest.quarantined.json` as {"ref", "reason", "at", "manifest"} (the record
        is written before the manifest is deleted: a crash between leaves the version visible).
        Idempotent; NotFound when the version is neither stored nor quarantined."""
        try:
            manifest = self.manifest(ref)
        except NotFound:
            if (record := self.quarantined(ref)) is not None:
                return record
            raise NotFound(f"no version {ref} in {self.description} to quarantine") from None
        except IntegrityError as e:  # an unreadable manifest: keep what is there
            manifest, reason = None, f"{reason}; {e}"
        record = {
            "ref": str(ref),
            "reason": reason,
            "at": _now(),
            "manifest": json.loads(manifest.to_json()) if manifest else None,
        }
        if record["manifest"] is None:
            record["manifest_bytes"] = self.backend.get_bytes(f"{ref.prefix}/{MANIFEST}").decode(errors="replace")
        self.backend.put_bytes(f"{ref.prefix}/{QUARANTINED}", json.dumps(record, indent=2, sort_keys=True).encode())
        self.backend.delete(f"{ref.prefix}/{MANIFEST}")
        log.warning("quarantined %s in %s: %s", ref, self.description, reason)
        return record

    def quarantined(self, ref: Ref) -> dict | None:
        """The quarantine record of a version that is quarantined now (record there, no valid
        manifest); None otherwise."""
        try:
            record = json.loads(self.backend.get_bytes(f"{ref.prefix}/{QUARANTINED}"))
        except NotFound:
            return None
        except ValueError:
            record = {"ref": str(ref), "reason": "unreadable quarantine record", "manifest": None}
        return None if self.exists(ref) else record

    def check(self, ref: Ref) -> list[str]:
        """verify, and quarantine the version when its bytes do not verify; the problems."""
        problems = self.verify(ref)
        if problems:
            self.quarantine(ref, f"does not verify: {'; '.join(problems[:5])}")
        return problems

    def verify_lineage(self, ref: Ref) -> dict[str, list[str]]:
        """Each version of ref's lineage that does not verify, with its problems: missing from the
        store, quarantined, or bytes that do not match; {} when all of it verifies."""
        bad: dict[str, list[str]] = {}
        seen: set[str] = set()

        def walk(node: dict) -> None:
            if node["ref"] in seen:
                return
            seen.add(node["ref"])
            if node.get("missing"):
                bad[node["ref"]] = ["missing from the store"]
            elif node.get("quarantined"):
                bad[node["ref"]] = [f"quarantined: {node.get('reason')}"]
            elif problems := self.verify(Ref.parse(node["ref"])):
                bad[node["ref"]] = problems
            for parent in node["parents"]:
                walk(parent)

        walk(self.lineage(ref))
        return bad

    # -- pins, dependants, deletion --------------------------------------------------------------

    def pin(self, ref: Ref, reason: str = "") -> None:
        """Keep a version from retention (`<prefix>/manifest.pinned.json`); NotFound if not stored."""
        if not self.exists(ref) and self.quarantined(ref) is None:
            raise NotFound(f"no version {ref} in {self.description} to pin")
        self.backend.put_bytes(f"{ref.prefix}/{PINNED}", json.dumps({"reason": reason, "at": _now()}).encode())

    def unpin(self, ref: Ref) -> None:
        self.backend.delete(f"{ref.prefix}/{PINNED}")

    def is_pinned(self, ref: Ref) -> bool:
        try:
            self.backend.get_bytes(f"{ref.prefix}/{PINNED}")
            return True
        except NotFound:
            return False

    def dependants(self, ref: Ref, manifests: Iterable[Manifest] | None = None) -> list[Ref]:
        """Every version whose lineage names ref (through its parents, theirs, ...), each after
        every version of the list it was made from; from one pass over the store's manifests (or
        the given ones)."""
        parents_of: dict[str, list[str]] = {}
        children: dict[str, list[str]] = {}
        refs: dict[str, Ref] = {}
        for m in self.ls() if manifests is None else manifests:
            refs[str(m.ref)] = m.ref
            parents_of[str(m.ref)] = list(m.parents)
            for p in m.parents:
                children.setdefault(p, []).append(str(m.ref))
        reached, stack = set(), [str(ref)]
        while stack:
            for child in children.get(stack.pop(), []):
                if child not in reached and child != str(ref):
                    reached.add(child)
                    stack.append(child)
        ordered, done = [], {str(ref)}
        while len(ordered) < len(reached):  # parents first (Kahn's order, by name among equals)
            ready = sorted(r for r in reached - done if all(p not in reached or p in done for p in parents_of[r]))
            if not ready:  # a cycle of parents (no pipeline writes one): the rest by name
                ready = sorted(reached - done)
            ordered += ready
            done.update(ready)
        return [refs[r] for r in ordered]

    def holds(self, ref: Ref) -> bool:
        """Whether any object of the version is stored (valid, quarantined or a partial upload)."""
        return bool(self.backend.list_sizes(ref.prefix))

    def delete(self, ref: Ref) -> int:
        """Remove a version: its manifest first (so a half-deleted version is invisible), then
        every object under its prefix, every object version of them on a versioned bucket. How
        many objects (object versions) went; NotFound when nothing of it is stored."""
        if not self.holds(ref):
            raise NotFound(f"no version {ref} in {self.description}")
        removed = self.backend.purge(f"{ref.prefix}/{MANIFEST}")
        removed += self.backend.purge(ref.prefix)
        log.info("deleted %s from %s (%d objects)", ref, self.description, removed)
        return removed

    def remove(self, ref: Ref, with_dependants: bool = False) -> list[Ref]:
        """Delete ref; with_dependants: and every version whose lineage names it, each before the
        versions it was made from (a crash half-way leaves no lineage naming a deleted version). Without it, a version
        some lineage names is refused: HasDependants lists them. What was removed, in order."""
        dependants = self.dependants(ref)
        if dependants and not with_dependants:
            raise HasDependants(ref, dependants)
        if not self.holds(ref):
            raise NotFound(f"no version {ref} in {self.description}")
        removed = []
        for r in [*reversed(dependants), ref]:
            if self.holds(r):
                self.delete(r)
                removed.append(r)
        return removed


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
