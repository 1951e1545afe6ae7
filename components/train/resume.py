"""Which checkpoint a run continues from: `train.resume` = auto | never | <version>.

The run's store is the truth. Rank 0 chooses among the store's versions; a node's own
`step-N/` directory is only a cache of one of them: what it holds is kept where it verifies
and fetched where it does not (a directory left by a run against another store is replaced).
Each node fetches only what its ranks load (components/checkpoint_fetch.py): the head, then
the blocks of the shard files their load plans read. A checkpoint only on a node's disk was
never committed and is never resumed from. A stored version whose objects are missing or
resized (one listing), or whose fetched bytes do not verify on any node, is quarantined (never
resumed again, never a parent) and the next newest is tried. Every rank then loads the same
version.

`auto` continues only this training identity's checkpoints (the identity includes the
schedule: steps, warmup, lr, seed, batch...). `<version>` seeds a run with another run's
checkpoint (its identity records the seed): its own checkpoints, once it has any, come first.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from components import checkpoint_format as ckpt
from components.checkpoint_fetch import Ranges, fetch_for_node, fetch_head, step_of_manifest
from components.config import ModelConfig
from components.prelaunch import ResumeError, check_shape
from components.store import ArtifactStore, IntegrityError, Manifest, NotFound, Ref, StoreError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Resumed:
    """The checkpoint a run continues from: its directory on this node and its store version."""

    path: Path
    ref: Ref
    step: int


def _quarantine(store: ArtifactStore, manifest: Manifest, why: str) -> None:
    log.warning("stored checkpoint %s does not verify (%s): quarantining it", manifest.ref, why)
    try:
        store.quarantine(manifest.ref, why)
    except StoreError as e:
        log.warning("could not quarantine %s: %s", manifest.ref, e)


def _head(store: ArtifactStore, root: Path, manifest: Manifest) -> Path:
    """The version's head on this node, once a listing shows every object at its size."""
    if problems := store.size_problems(manifest):
        raise IntegrityError("; ".join(problems[:3]))
    return fetch_head(store, root, manifest)


def _newest_stored(store: ArtifactStore, root: Path, model: ModelConfig, identity: str, max_step: int,
                   damaged: frozenset):  # fmt: skip
    """The newest stored checkpoint of this identity at or before `max_step` whose objects are
    all there and whose head verifies, its head on this node; damaged ones are quarantined on
    the way. `damaged`: versions a node found damaged this time (their quarantine may have failed)."""
    stored = [m for m in store.versions("checkpoint", model.name) if m.metadata.get("identity") == identity]
    usable = [(s, m) for m in stored if (s := step_of_manifest(m)) is not None and s <= max_step]
    usable = [(s, m) for s, m in usable if str(m.ref) not in damaged]
    for _, manifest in sorted(usable, key=lambda sm: (sm[0], sm[1].created), reverse=True):
        try:
            return manifest, _head(store, root, manifest)
        except (IntegrityError, ckpt.CheckpointError) as e:
            _quarantine(store, manifest, str(e))
        except NotFound as e:  # gone meanwhile (retention): not evidence of damage
            log.warning("skipping stored checkpoint %s: %s", manifest.ref, e)
    _say_local_only(root, identity)
    return None


def _say_local_only(root: Path, identity: str) -> None:
    for candidate in ckpt.local_checkpoints(root):
        log.info("ignoring %s on this node: no such version of training %s in the run's store", candidate, identity)


def _decide(mode: str, root: Path, store: ArtifactStore, model: ModelConfig, identity: str, max_step: int,
            damaged: frozenset = frozenset()):  # fmt: skip
    if mode == "never":
        return None
    own = _newest_stored(store, root, model, identity, max_step, damaged)
    if own is not None or mode == "auto":
        return own
    try:
        manifest = store.resolve("checkpoint", model.name, Ref("checkpoint", model.name, mode).version)
    except NotFound:
        if (record := store.quarantined(Ref("checkpoint", model.name, mode))) is not None:
            why = record.get("reason", "")
            raise ResumeError(f"train.resume={mode}: checkpoint/{model.name}@{mode} is quarantined: {why}") from None
        raise ResumeError(f"train.resume={mode}: no checkpoint/{model.name}@{mode} in {store.description}") from None
    if str(manifest.ref) in damaged:  # its quarantine could not be written
        raise ResumeError(f"train.resume={mode}: {manifest.ref} does not verify in {store.description}")
    try:
        path = _head(store, root, manifest)
    except (IntegrityError, ckpt.CheckpointError) as e:
        _quarantine(store, manifest, str(e))
        raise ResumeError(f"train.resume={mode}: {manifest.ref} does not verify ({e}); it is quarantined") from None
    meta = json.loads((path / "meta.json").read_text())
    check_shape(meta, model, f"train.resume={mode}")
    if meta["step"] > max_step:
        raise ResumeError(f"train.resume={mode} is at step {meta['step']}, beyond train.steps={max_step}")
    return manifest, path


def find_resume_checkpoint(
    mode: str,
    root: Path,
    store: ArtifactStore,
    model: ModelConfig,
    identity: str,
    rank: int,
    max_step: int,
    reads: Callable[[Path], Ranges],
) -> Resumed | None:
    """Rank 0 decides among the store's versions; every node then fetches the part of that
    version its ranks load (`reads(path)`: a rank's reads, planned against the head there)
    before any rank loads it. A version a node finds damaged is quarantined by rank 0 and the
    choice made again; a store failure or any other error on any rank stops every rank with
    the same ResumeError (the launcher's relaunch tries again; never an older checkpoint
    silently). Checkpoints beyond `max_step` (train.steps) are never chosen."""
    damaged: set[str] = set()  # never chosen again, even where the quarantine could not be written
    while True:
        choice: list = [None]
        if rank == 0:
            try:
                found = _decide(mode, root, store, model, identity, max_step, frozenset(damaged))
                choice = [("resume", str(found[0].ref), found[1].name) if found is not None else None]
            except ResumeError as e:  # said on every rank, not only here while the others wait
                choice = [("refused", str(e))]
            except Exception as e:  # the store failing past its retries, a full disk: never an older one
                choice = [("refused", f"train.resume={mode}: choosing in {store.description}: {type(e).__name__}: {e}")]
        dist.broadcast_object_list(choice, src=0)
        if choice[0] is None:
            return None
        if choice[0][0] == "refused":
            raise ResumeError(choice[0][1])
        ref, name = Ref.parse(choice[0][1]), choice[0][2]
        _, failures = fetch_for_node(store, root, ref, reads)
        if not failures:
            dist.barrier()
            return Resumed(root / name, ref, json.loads((root / name / "meta.json").read_text())["step"])
        if other := [why for kind, why in failures if kind != "damage"]:
            raise ResumeError(f"resuming {ref} from {store.description}: {other[0]}")
        damaged.add(str(ref))
        if rank == 0:
            try:
                _quarantine(store, store.manifest(ref), failures[0][1])
            except StoreError as e:
                log.warning("could not quarantine %s: %s", ref, e)
