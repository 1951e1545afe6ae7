"""Which checkpoint a run continues from: `train.resume` = auto | never | <version>."""

from __future__ import annotations

import logging
from pathlib import Path

import torch.distributed as dist

from components import checkpoint_format as ckpt
from components.config import ModelConfig
from components.store import ArtifactStore, NotFound, Ref, StoreError
from components.train.prelaunch import ResumeError, check_shape

log = logging.getLogger(__name__)


def _newest_valid_local(root: Path, identity: str) -> Path | None:
    for candidate in ckpt.local_checkpoints(root):
        try:
            meta = ckpt.verify(candidate)
        except ckpt.CheckpointError as e:
            log.warning("skipping checkpoint %s: %s", candidate.name, e)
            continue
        if meta.get("identity") == identity:
            return candidate
    return None


def _from_store(store: ArtifactStore, root: Path, model_name: str, version: str) -> Path:
    manifest = store.resolve("checkpoint", model_name, version)
    step = manifest.metadata.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:  # it names a directory here
        raise ckpt.CheckpointError(f"{manifest.ref}: its manifest's step {step!r} is not a step number")
    dest = root / f"step-{step}"
    store.fetch(manifest, dest)
    ckpt.verify(dest)
    return dest


def _decide(mode: str, root: Path, store: ArtifactStore, model: ModelConfig, identity: str) -> Path | None:
    if mode == "never":
        return None
    if mode == "auto":
        local = _newest_valid_local(root, identity)
        if local is not None:
            return local
        try:
            mine = [m for m in store.versions("checkpoint", model.name) if m.metadata.get("identity") == identity]
        except StoreError as e:
            log.warning("cannot list checkpoints in the store: %s", e)
            return None
        for manifest in sorted(mine, key=lambda m: m.metadata.get("step", 0), reverse=True):
            try:
                return _from_store(store, root, model.name, manifest.ref.version)
            except (StoreError, ckpt.CheckpointError) as e:
                log.warning("skipping stored checkpoint %s: %s", manifest.ref, e)
        return None
    try:
        path = _from_store(store, root, model.name, Ref("checkpoint", model.name, mode).version)
    except NotFound:
        raise ResumeError(f"train.resume={mode}: no checkpoint/{model.name}@{mode} in {store.description}") from None
    check_shape(ckpt.verify(path), model, f"train.resume={mode}")
    return path


def find_resume_checkpoint(
    mode: str, root: Path, store: ArtifactStore, model: ModelConfig, identity: str, rank: int
) -> Path | None:
    """Rank 0 decides (verifying hashes, logging every rejected candidate); all ranks get its answer."""
    choice = [None]
    if rank == 0:
        found = _decide(mode, root, store, model, identity)
        choice = [str(found) if found else None]
    dist.broadcast_object_list(choice, src=0)
    return Path(choice[0]) if choice[0] else None
