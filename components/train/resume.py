"""Which checkpoint a run continues from: `train.resume` = auto | never | <version>.

The run's store is the truth. Rank 0 chooses among the store's versions; a node's own
`step-N/` directory is only a cache of one of them: its files are kept where they match the
stored version's manifest and fetched where they do not (a directory left by a run against
another store, or one whose bytes differ, is replaced). A checkpoint only on a node's disk was
never committed and is never resumed from. A stored version whose bytes do not verify is
quarantined (never resumed again, never a parent) and the next newest is tried. Every rank
then loads the same version.

`auto` continues only this training identity's checkpoints (the identity includes the
schedule: steps, warmup, lr, seed, batch...). `<version>` seeds a run with another run's
checkpoint (its identity records the seed): its own checkpoints, once it has any, come first.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from components import checkpoint_format as ckpt
from components.config import ModelConfig
from components.store import ArtifactStore, IntegrityError, Manifest, NotFound, Ref, StoreError
from components.train.prelaunch import ResumeError, check_shape

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Resumed:
    """The checkpoint a run continues from: its directory on this node and its store version."""

    path: Path
    ref: Ref
    step: int


def _step(manifest: Manifest) -> int | None:
    step = manifest.metadata.get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None


def materialize(store: ArtifactStore, root: Path, manifest: Manifest) -> Path:
    """The stored version complete in `root/step-N`: local files that match its manifest are
    kept, the rest fetched (sha256-verified); a local directory of other content is replaced."""
    step = _step(manifest)
    if step is None:  # it names a directory here
        bad = manifest.metadata.get("step")
        raise ckpt.CheckpointError(f"{manifest.ref}: its manifest's step {bad!r} is not a step number")
    dest = root / f"step-{step}"
    index = dest / ckpt.INDEX
    stored_index = manifest.files.get(ckpt.INDEX, {}).get("sha256")
    if dest.exists() and (not index.is_file() or ckpt.sha256_file(index) != stored_index):
        log.info("%s on this node is not %s of %s: replacing it", dest.name, manifest.ref, store.description)
        shutil.rmtree(dest)
    stale = [p for p in dest.glob("*") if p.is_file() and p.name not in manifest.files]
    for extra in (p for p in stale if not p.name.startswith(".liftoff")):  # the store's fetch stamp stays
        extra.unlink()  # e.g. another world size's rank files: DCP must see the stored version only
    store.fetch(manifest, dest)
    ckpt.verify(dest)
    return dest


def _quarantine(store: ArtifactStore, manifest: Manifest, why: str) -> None:
    log.warning("stored checkpoint %s does not verify (%s): quarantining it", manifest.ref, why)
    try:
        store.quarantine(manifest.ref, why)
    except StoreError as e:
        log.warning("could not quarantine %s: %s", manifest.ref, e)


def _newest_stored(store: ArtifactStore, root: Path, model: ModelConfig, identity: str, max_step: int):
    """The newest stored checkpoint of this identity at or before `max_step` whose bytes verify,
    complete on this node; damaged ones are quarantined on the way."""
    try:
        stored = [m for m in store.versions("checkpoint", model.name) if m.metadata.get("identity") == identity]
    except StoreError as e:
        log.warning("cannot list checkpoints in %s: %s", store.description, e)
        return None
    usable = [m for m in stored if _step(m) is not None and _step(m) <= max_step]
    for manifest in sorted(usable, key=lambda m: (_step(m), m.created), reverse=True):
        try:
            return manifest, materialize(store, root, manifest)
        except (IntegrityError, ckpt.CheckpointError) as e:
            _quarantine(store, manifest, str(e))
        except StoreError as e:  # unreachable or gone meanwhile: not evidence of damage
            log.warning("skipping stored checkpoint %s: %s", manifest.ref, e)
    _say_local_only(root, identity)
    return None


def _say_local_only(root: Path, identity: str) -> None:
    for candidate in ckpt.local_checkpoints(root):
        log.info("ignoring %s on this node: no such version of training %s in the run's store", candidate, identity)


def _decide(mode: str, root: Path, store: ArtifactStore, model: ModelConfig, identity: str, max_step: int):
    if mode == "never":
        return None
    own = _newest_stored(store, root, model, identity, max_step)
    if own is not None or mode == "auto":
        return own
    try:
        manifest = store.resolve("checkpoint", model.name, Ref("checkpoint", model.name, mode).version)
    except NotFound:
        if (record := store.quarantined(Ref("checkpoint", model.name, mode))) is not None:
            why = record.get("reason", "")
            raise ResumeError(f"train.resume={mode}: checkpoint/{model.name}@{mode} is quarantined: {why}") from None
        raise ResumeError(f"train.resume={mode}: no checkpoint/{model.name}@{mode} in {store.description}") from None
    try:
        path = materialize(store, root, manifest)
    except (IntegrityError, ckpt.CheckpointError) as e:
        _quarantine(store, manifest, str(e))
        raise ResumeError(f"train.resume={mode}: {manifest.ref} does not verify ({e}); it is quarantined") from None
    meta = ckpt.verify(path)
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
) -> Resumed | None:
    """Rank 0 decides among the store's versions; every node then holds that version complete
    (fetching what its own disk lacks or holds otherwise) before any rank loads it.
    Checkpoints beyond `max_step` (train.steps) are never chosen."""
    choice = [None]
    if rank == 0:
        found = _decide(mode, root, store, model, identity, max_step)
        if found is not None:
            manifest, path = found
            choice = [(str(manifest.ref), path.name)]
    dist.broadcast_object_list(choice, src=0)
    if choice[0] is None:
        return None
    ref, name = Ref.parse(choice[0][0]), choice[0][1]
    path = root / name
    if int(os.environ.get("LOCAL_RANK", "0")) == 0 and rank != 0:  # rank 0's node already has it whole
        path = materialize(store, root, store.manifest(ref))
    dist.barrier()
    return Resumed(path, ref, json.loads((path / "meta.json").read_text())["step"])
