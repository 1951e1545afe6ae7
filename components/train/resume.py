"""Which checkpoint a run continues from: `train.resume` = auto | never | <version>.

Rank 0 chooses; then every node holds that checkpoint complete before anyone loads it: a
node's own directory holds only its ranks' shards, so a node whose copy does not verify
fetches the version from the store, where the ranks' parts were joined.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch.distributed as dist

from components import checkpoint_format as ckpt
from components.config import ModelConfig
from components.store import ArtifactStore, Manifest, NotFound, Ref, StoreError
from components.train.prelaunch import ResumeError, check_shape

log = logging.getLogger(__name__)


def _step(manifest: Manifest) -> int | None:
    step = manifest.metadata.get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None


def _newest_valid_local(root: Path, identity: str, max_step: int) -> Path | None:
    for candidate in ckpt.local_checkpoints(root):
        if ckpt.step_of(candidate) > max_step:
            continue
        try:
            meta = ckpt.verify(candidate)
        except ckpt.CheckpointError as e:  # another node's shards missing is expected; damage is not
            partial = str(e).endswith(": missing")
            log.log(logging.INFO if partial else logging.WARNING, "skipping checkpoint %s: %s", candidate.name, e)
            continue
        if meta.get("identity") == identity:
            return candidate
    return None


def _from_store(store: ArtifactStore, root: Path, model_name: str, version: str) -> Path:
    manifest = store.resolve("checkpoint", model_name, version)
    step = _step(manifest)
    if step is None:  # it names a directory here
        bad = manifest.metadata.get("step")
        raise ckpt.CheckpointError(f"{manifest.ref}: its manifest's step {bad!r} is not a step number")
    dest = root / f"step-{step}"
    store.fetch(manifest, dest)
    ckpt.verify(dest)
    return dest


def _newest_of_identity(store: ArtifactStore, root: Path, model: ModelConfig, identity: str, max_step: int):
    """The newest checkpoint of this training identity at or before `max_step`: this node's
    own when it is complete and at least as new as the store's, else fetched from the store."""
    local = _newest_valid_local(root, identity, max_step)
    try:
        stored = [m for m in store.versions("checkpoint", model.name) if m.metadata.get("identity") == identity]
    except StoreError as e:
        log.warning("cannot list checkpoints in the store: %s", e)
        stored = []
    usable = [m for m in stored if _step(m) is not None and _step(m) <= max_step]
    for manifest in sorted(usable, key=_step, reverse=True):
        if local is not None and ckpt.step_of(local) >= _step(manifest):
            return local
        try:
            return _from_store(store, root, model.name, manifest.ref.version)
        except (StoreError, ckpt.CheckpointError) as e:
            log.warning("skipping stored checkpoint %s: %s", manifest.ref, e)
    return local


def _decide(
    mode: str, root: Path, store: ArtifactStore, model: ModelConfig, identity: str, max_step: int, relaunch: bool
) -> Path | None:
    if mode == "never":
        return None
    if mode == "auto":
        return _newest_of_identity(store, root, model, identity, max_step)
    if relaunch:  # a named version seeds the first attempt; a relaunch keeps what was trained since
        own = _newest_of_identity(store, root, model, identity, max_step)
        if own is not None:
            return own
    try:
        path = _from_store(store, root, model.name, Ref("checkpoint", model.name, mode).version)
    except NotFound:
        raise ResumeError(f"train.resume={mode}: no checkpoint/{model.name}@{mode} in {store.description}") from None
    meta = ckpt.verify(path)
    check_shape(meta, model, f"train.resume={mode}")
    if meta["step"] > max_step:
        raise ResumeError(f"train.resume={mode} is at step {meta['step']}, beyond train.steps={max_step}")
    return path


def find_resume_checkpoint(
    mode: str,
    root: Path,
    store: ArtifactStore,
    model: ModelConfig,
    identity: str,
    rank: int,
    max_step: int,
    relaunch: bool = False,
) -> Path | None:
    """Rank 0 decides (verifying hashes, logging every rejected candidate); every node then
    makes sure it holds the chosen checkpoint complete, fetching it from the store if not.
    Checkpoints beyond `max_step` (train.steps) are never chosen: a shorter rerun trains its
    own steps instead of handing back a longer run's model."""
    choice = [None, None]
    if rank == 0:
        found = _decide(mode, root, store, model, identity, max_step, relaunch)
        if found is not None:
            identity_there = json.loads((found / ckpt.INDEX).read_text())["meta"]["identity"]  # verified above
            choice = [found.name, ckpt.version_of(identity_there, found)]
    dist.broadcast_object_list(choice, src=0)
    name, version = choice
    if name is None:
        return None
    path = root / name
    if int(os.environ.get("LOCAL_RANK", "0")) == 0 and rank != 0:  # rank 0's node already has it whole
        try:
            ckpt.verify(path)
        except ckpt.CheckpointError:
            path = _from_store(store, root, model.name, version)
    dist.barrier()
    return path
