"""Damage in the store: re-hash a version's stored bytes, and quarantine one that does not verify.

A quarantined version's manifest is moved aside to `<prefix>/manifest.quarantined.json` with the
reason and time: the version no longer exists for the store while its bytes stay for forensics.
`Damage` is the part of ArtifactStore (artifacts.py) that does this.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

from components.store.keys import MANIFEST, QUARANTINED, IntegrityError, Manifest, NotFound, Ref, utc_now

if TYPE_CHECKING:
    from components.store.artifacts import Backend

log = logging.getLogger(__name__)


class Damage:
    """verify, quarantine, quarantined, check, verify_lineage: mixed into ArtifactStore, whose
    backend, description, manifest, exists and lineage they use."""

    backend: Backend
    description: str

    def verify(self, ref: Ref | Manifest) -> list[str]:
        """Re-hash a version's stored objects against its manifest (each streamed; nothing is
        kept): one line per problem (missing, wrong size, wrong sha256); [] when it verifies."""
        manifest = ref if isinstance(ref, Manifest) else self.manifest(ref)
        prefix = manifest.ref.prefix
        problems = self.size_problems(manifest)
        for rel, entry in sorted(manifest.files.items()):
            key = f"{prefix}/{rel}"
            if any(p.startswith(f"{key}: ") for p in problems):
                continue  # missing or of another size: not worth streaming
            try:
                got, size = self.backend.digest(key)
            except NotFound:
                problems.append(f"{key}: missing")
                continue
            if (got, size) != (entry["sha256"], entry["size"]):
                problems.append(f"{key}: sha256 {got[:12]}, the manifest says {entry['sha256'][:12]}")
        return sorted(problems)

    def size_problems(self, manifest: Manifest) -> list[str]:
        """One listing, no bytes read: each of the version's objects that is missing or not at
        its manifest's size (a truncated or replaced upload); [] when all are there."""
        prefix = manifest.ref.prefix
        present = self.backend.list_sizes(prefix)
        problems = []
        for rel, entry in sorted(manifest.files.items()):
            if rel not in present:
                problems.append(f"{prefix}/{rel}: missing")
            elif present[rel] != entry["size"]:
                problems.append(f"{prefix}/{rel}: {present[rel]} bytes, the manifest says {entry['size']}")
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
            "at": utc_now(),
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
