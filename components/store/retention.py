"""Which stored checkpoints are kept, and deleting the rest.

A checkpoint version `<identity>-step<N>-<digest>` (manifest metadata `identity` and `step`) of a
training identity is kept when it is

- one of the newest `keep` of that identity, by step;
- named in some lineage: reached through `parents` from any version of kind model, eval or run,
  or from a checkpoint of another training identity (a run continued from it with
  `train.resume=<version>`), however many steps away;
- pinned (`liftoff artifacts pin`, `ArtifactStore.pin`).

Every other version of the identity is deleted, manifest first, with every object version of
its objects on a versioned bucket. Quarantined versions are not touched (their bytes are kept for
forensics until `liftoff artifacts rm` removes them).
"""

from __future__ import annotations

import logging
import re

from components.store.artifacts import ArtifactStore
from components.store.keys import IntegrityError, InvalidKey, Manifest, NotFound, Ref

log = logging.getLogger(__name__)

LINEAGE_ROOTS = ("model", "eval", "run")  # versions whose lineage keeps what it names
_STEP = re.compile(r"-step(\d+)-[^-]*$")


def step_of(m: Manifest) -> int:
    """A checkpoint's step: its metadata's `step`, else the `-step<N>-` of its version name."""
    step = m.metadata.get("step")
    if isinstance(step, int) and not isinstance(step, bool):
        return step
    match = _STEP.search(m.ref.version)
    return int(match.group(1)) if match else -1


def identity_of(m: Manifest) -> str | None:
    identity = m.metadata.get("identity")
    if isinstance(identity, str) and identity:
        return identity
    match = _STEP.search(m.ref.version)
    return m.ref.version[: match.start()] if match else None


def in_lineage(store: ArtifactStore, besides: str | None = None) -> set[str]:
    """Every version (as `KIND/NAME@VERSION`) that some lineage names: reached through parents
    from every model, eval and run, and from every checkpoint whose identity is not `besides`."""
    roots: list[Manifest] = []
    for kind in LINEAGE_ROOTS:
        roots += store.ls(kind)
    roots += [m for m in store.ls("checkpoint") if besides is None or identity_of(m) != besides]
    named: set[str] = set()
    stack = [p for m in roots for p in m.parents]
    while stack:
        ref = stack.pop()
        if ref in named:
            continue
        named.add(ref)
        try:
            stack += store.manifest(Ref.parse(ref)).parents
        except NotFound:
            record = store.quarantined(Ref.parse(ref)) or {}  # a quarantined version's lineage still counts
            stack += list((record.get("manifest") or {}).get("parents", []))
        except (IntegrityError, InvalidKey):
            continue
    return named


def plan_retention(store: ArtifactStore, model_name: str, identity: str, keep: int) -> tuple[list[Ref], list[Ref]]:
    """(kept, to delete) among the stored checkpoints of one training identity, newest first."""
    if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
        raise ValueError(f"retention keep={keep!r}: keep at least the newest checkpoint (an integer >= 1)")
    ours = [m for m in store.versions("checkpoint", model_name) if identity_of(m) == identity]
    ours.sort(key=lambda m: (step_of(m), m.created, m.ref.version), reverse=True)
    newest, older = ours[:keep], ours[keep:]
    if not older:
        return [m.ref for m in newest], []
    named = in_lineage(store, besides=identity)
    kept, delete = [m.ref for m in newest], []
    for m in older:
        (kept if str(m.ref) in named or store.is_pinned(m.ref) else delete).append(m.ref)
    return kept, delete


def apply_retention(store: ArtifactStore, model_name: str, identity: str, keep: int) -> list[Ref]:
    """Delete the checkpoints of one training identity that the policy does not keep (see the
    module docstring); the refs it deleted, newest first."""
    _, delete = plan_retention(store, model_name, identity, keep)
    deleted = []
    for ref in delete:
        try:
            store.delete(ref)
        except NotFound:  # another process deleted it first
            continue
        deleted.append(ref)
    if deleted:
        log.info(
            "retention: deleted %d checkpoint(s) of %s beyond the newest %d: %s",
            len(deleted),
            identity,
            keep,
            ", ".join(r.version for r in deleted),
        )
    return deleted
