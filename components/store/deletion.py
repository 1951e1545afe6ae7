"""Pins, dependants and deletion: what keeps a version, what its removal would break, removing it.

A pin (`<prefix>/manifest.pinned.json`) keeps a version from retention. `delete` removes a version:
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


class Deletion:
    """pin, unpin, is_pinned, dependants, holds, delete, remove: mixed into ArtifactStore, whose
    backend, description, exists, quarantined and ls they use."""

    backend: Backend
    description: str

    def pin(self, ref: Ref, reason: str = "") -> None:
        """Keep a version from retention (`<prefix>/manifest.pinned.json`); NotFound if not stored."""
        if not self.exists(ref) and self.quarantined(ref) is None:
            raise NotFound(f"no version {ref} in {self.description} to pin")
        self.backend.put_bytes(f"{ref.prefix}/{PINNED}", json.dumps({"reason": reason, "at": utc_now()}).encode())

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
