"""Pins, dependants and deletion: what keeps a version, what its removal would break, removing it.

A pin (`<prefix>/manifest.pinned.json`) keeps a version from retention, and from `remove` unless
forced. `delete` removes a version:
the manifest first (a half-deleted version is invisible), then every object and, on a versioned
bucket, every object version under its prefix. `Deletion` is that part of ArtifactStore (artifacts.py).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

from components.store.keys import MANIFEST, PINNED, Manifest, NotFound, Ref, StoreError, utc_now

if TYPE_CHECKING:
    from components.store.artifacts import Backend

log = logging.getLogger(__name__)


class HasDependants(StoreError):
    """A version some other version's lineage names: removing it alone would break that lineage."""

    def __init__(self, ref: Ref, dependants: list[Ref]):
        self.ref, self.dependants = ref, dependants
        names = ", ".join(map(str, dependants))
        super().__init__(
            f"{ref} is in the lineage of {len(dependants)} version{'s' if len(dependants) != 1 else ''}: "
            f"{names}; --with-dependants removes them too"
        )


class Pinned(StoreError):
    """A removal that would take a pinned version (the one named, or a dependant of it)."""

    def __init__(self, ref: Ref, pinned: list[Ref]):
        self.ref, self.pinned = ref, pinned
        others = [r for r in pinned if r != ref]
        what = f"{ref} is pinned" if ref in pinned else f"{ref}:"
        if others:
            many = len(others) > 1
            what += " and" if ref in pinned else ""
            what += f" its dependant{'s' * many} {', '.join(map(str, others))} {'are' if many else 'is'} pinned"
        super().__init__(f"{what}; nothing removed (unpin, or --force removes pinned versions too)")


class Deletion:
    """pin, unpin, pin_record, is_pinned, pinned_versions, dependants, holds, delete, remove: mixed
    into ArtifactStore, whose backend, description, exists, quarantined and ls they use."""

    backend: Backend
    description: str

    def pin(self, ref: Ref, reason: str = "") -> None:
        """Keep a version from retention (`<prefix>/manifest.pinned.json`); NotFound if not stored."""
        if not self.exists(ref) and self.quarantined(ref) is None:
            raise NotFound(f"no version {ref} in {self.description} to pin")
        self.backend.put_bytes(f"{ref.prefix}/{PINNED}", json.dumps({"reason": reason, "at": utc_now()}).encode())

    def unpin(self, ref: Ref) -> None:
        """Let retention have a version again; NotFound when it is not stored, or not pinned."""
        if not self.is_pinned(ref):
            if not self.holds(ref):
                raise NotFound(f"no version {ref} in {self.description} to unpin")
            raise NotFound(f"{ref} is not pinned")
        self.backend.delete(f"{ref.prefix}/{PINNED}")

    def pin_record(self, ref: Ref) -> dict | None:
        """The pin of a version (`{"reason", "at"}`), None when it is not pinned."""
        try:
            raw = self.backend.get_bytes(f"{ref.prefix}/{PINNED}")
        except NotFound:
            return None
        try:
            record = json.loads(raw)
        except ValueError:
            record = None
        return record if isinstance(record, dict) else {"reason": "", "at": ""}

    def is_pinned(self, ref: Ref) -> bool:
        return self.pin_record(ref) is not None

    def pinned_versions(self, kind: str, name: str) -> set[str]:
        """The pinned versions of kind/name, from one listing."""
        return {
            rel.split("/", 1)[0]
            for rel in self.backend.list_sizes(f"{kind}/{name}")
            if rel.count("/") == 1 and rel.endswith(f"/{PINNED}")
        }

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

    def remove(self, ref: Ref, with_dependants: bool = False, force: bool = False) -> list[Ref]:
        """Delete ref; with_dependants: and every version whose lineage names it, each before the
        versions it was made from (a crash half-way leaves no lineage naming a deleted version). Without it, a version
        some lineage names is refused: HasDependants lists them. A pinned version among those
        to go refuses the whole removal (Pinned names them) unless force. What was removed, in order."""
        dependants = self.dependants(ref)
        if dependants and not with_dependants:
            raise HasDependants(ref, dependants)
        if not self.holds(ref):
            raise NotFound(f"no version {ref} in {self.description}")
        pinned = [r for r in [ref, *dependants] if self.is_pinned(r)]
        if pinned and not force:
            raise Pinned(ref, pinned)
        removed = []
        for r in [*reversed(dependants), ref]:
            if self.holds(r):
                self.delete(r)
                removed.append(r)
        return removed
