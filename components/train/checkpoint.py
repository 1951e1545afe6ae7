"""Atomic, verifiable, resumable checkpoints with torch.distributed.checkpoint (DCP).

A checkpoint is written to `step-N.tmp/` on every node: DCP shards of model and optimizer, one
`rank{r}.pt` per rank (RNG states, tensors only), `meta.json` (step, global samples consumed, loss,
identity, model shape), then `checkpoint.json` with the sha256 of every rank's files; the files
are fsynced and the directory renamed to `step-N/`. The store joins the nodes' parts into one
version; only a directory whose checkpoint.json verifies (complete: every rank's files) is
ever resumed from. Loading unpickles nothing but an allowlist.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException as DcpCheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from components.checkpoint_fetch import Ranges, read_ranges
from components.checkpoint_format import (
    HISTORY,
    INDEX,
    MODEL_KEY,
    CheckpointError,
    ClusteredWriter,
    file_entries,
    fsync_dir,
    index_bytes,
    load_state,
    local_checkpoints,
    own_files,
    version_of,
    write_index,
)
from components.store import ArtifactStore, Ref, StoreError
from components.store.retention import apply_retention

log = logging.getLogger(__name__)

# The optimizer's state is saved flattened, every entry under its parameter's name (as
# torchtitan saves it): "optim.state.<fqn>.exp_avg", "optim.param_groups.<fqn>.lr". Nested,
# the param groups are one list whose `params` name the parameters a rank holds, which differ
# between pipeline stages: DCP keeps one rank's list and the other stages' loads fail. Named
# in meta.json; a checkpoint without the name is nested (written before) and loads as it was.
OPTIM_STATE = "optim_state"
FLAT = "flat"


def state_dicts(model, optimizer, flat: bool = True) -> dict:
    """The {"model", "optim"} state DCP saves and loads, the optimizer's flattened by name."""
    options = StateDictOptions(flatten_optimizer_state_dict=flat)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    return {MODEL_KEY: model_sd, "optim": optim_sd}


@dataclass
class StoreTarget:
    """Where finished checkpoints are published: checkpoint/<model name>@<version of_it>."""

    store: ArtifactStore
    model_name: str
    identity: str
    parents: list[str]


class Checkpointer:
    """Saves step-N checkpoints on every node and publishes them to the store, where the
    ranks' parts are joined: no node ever sees another node's files.

    A save: every rank writes its DCP shards into `step-N.tmp/` on its own disk; then every
    rank hashes its own files, rank 0 joins the hashes into the index that every node writes,
    and each node's first local rank renames the directory (`seal`). Then every rank uploads
    its own files and rank 0 writes the version's manifest only once every rank's upload is in
    and every indexed file is in the store at its size (`publish`, in the background).
    Synchronous saves block until sealed; asynchronous ones only while DCP stages the state."""

    def __init__(self, root: Path, keep: int, async_save: bool, rank: int, target: StoreTarget,
                 block_bytes: int = 64 << 20):  # fmt: skip
        self.root, self.keep, self.async_save, self.rank, self.target = root, keep, async_save, rank, target
        self.block_bytes = block_bytes  # the shard files' verified unit of a partial fetch (checkpoint_fetch)
        self.local_leader = int(os.environ.get("LOCAL_RANK", "0")) == 0  # renames and prunes this node's dirs
        self.world = dist.get_world_size()
        self._pending: tuple | None = None  # (future, tmp dir, step, meta) of an async save
        self._background: threading.Thread | None = None
        self._background_error: BaseException | None = None
        self.publish_errors: list[str] = []  # reported at the end of training (rank 0); never kill it
        self._pg = dist.new_group(backend="gloo")  # saves run collectives off the training stream
        # the last save's time on the training thread, and its seal and publish in the background
        self.seconds = {"checkpoint_blocking_s": 0.0, "checkpoint_background_s": 0.0}
        root.mkdir(parents=True, exist_ok=True)

    def save(self, step: int, model, optimizer, meta: dict, rank_state: dict, history: Path | None = None) -> None:
        """`history`: rank 0's metrics.jsonl, kept with the checkpoint (a resume on a new pod restores it)."""
        t0 = time.perf_counter()
        try:
            self._save(step, model, optimizer, {**meta, OPTIM_STATE: FLAT}, rank_state, history)
        finally:
            self.seconds["checkpoint_blocking_s"] = time.perf_counter() - t0

    def _save(self, step: int, model, optimizer, meta: dict, rank_state: dict, history: Path | None) -> None:
        self.wait()
        tmp = self.root / f"step-{step}.tmp"
        if self.local_leader and tmp.exists():
            shutil.rmtree(tmp)  # left by a process killed mid-save; never resumed from
        dist.barrier(group=self._pg)
        with self._no_partial(tmp, step):
            tmp.mkdir(parents=True, exist_ok=True)
            state = state_dicts(model, optimizer)
            torch.save(rank_state, tmp / f"rank{self.rank}.pt")
            if history is not None and history.is_file():
                shutil.copyfile(history, tmp / HISTORY)
            writer = ClusteredWriter(str(tmp), sync_files=True)
            if self.async_save:
                future = dcp.async_save(state, storage_writer=writer, process_group=self._pg)
                self._pending = (future, tmp, step, meta)
                return
            dcp.save(state, storage_writer=writer, process_group=self._pg)
            final = self._seal(tmp, step, meta)
        self._in_background(self._publish, final, step, meta)

    @contextlib.contextmanager
    def _no_partial(self, tmp: Path, step: int):
        """A failed save (a full disk, a dead peer) removes its partial directory and says so;
        the finished checkpoints before it are never touched."""
        try:
            yield
        except (Exception, DcpCheckpointException) as e:  # DCP's exception derives from BaseException
            shutil.rmtree(tmp, ignore_errors=True)
            free = shutil.disk_usage(self.root).free / 1e6
            lines = [ln for ln in str(e).strip().splitlines() if "Error" in ln] or [type(e).__name__]
            first = lines[-1].strip()
            raise CheckpointError(
                f"checkpoint step-{step} could not be written to {self.root} ({free:.1f} MB free): "
                f"{first}; earlier checkpoints are intact"
            ) from e

    @property
    def has_pending(self) -> bool:
        return self._pending is not None

    def pending_done(self) -> bool:
        return self._pending is None or self._pending[0].done()

    def finish_pending(self) -> None:
        """Complete an async save: wait for this rank's writes, then seal and publish it in the
        background (sealing's collectives wait for the other ranks' writes)."""
        if self._pending is None:
            return
        future, tmp, step, meta = self._pending
        self._pending = None
        with self._no_partial(tmp, step):
            future.result()

        def seal_and_publish() -> None:
            with self._no_partial(tmp, step):
                final = self._seal(tmp, step, meta)
            self._publish(final, step, meta)

        self._in_background(seal_and_publish)

    def wait(self) -> None:
        """Every save started so far is sealed and its publish finished (or its error raised)."""
        self.finish_pending()
        if self._background is not None:
            self._background.join()
            self._background = None
        if self._background_error is not None:
            error, self._background_error = self._background_error, None
            raise error

    def _in_background(self, fn, *args) -> None:
        def run() -> None:
            t0 = time.perf_counter()
            try:
                fn(*args)
            except BaseException as e:  # raised on the training thread by the next wait()
                self._background_error = e
            finally:
                self.seconds["checkpoint_background_s"] = time.perf_counter() - t0

        self._background = threading.Thread(target=run, name=f"checkpoint-{fn.__name__}", daemon=True)
        self._background.start()

    def _seal(self, tmp: Path, step: int, meta: dict) -> Path:
        """Every rank, once its files are written: hash them, agree on the index (every rank's
        files), write it on every node, rename. Collectives on the checkpoint group only."""
        if self.rank == 0:
            (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        mine = file_entries(tmp, own_files(tmp, self.rank), self.block_bytes)
        everyone: list = [None] * self.world
        dist.all_gather_object(everyone, mine, group=self._pg)
        files = {name: entry for part in everyone for name, entry in part.items()}
        index = [index_bytes(files, meta)]  # rank 0's bytes, so every node's index (and version) is identical
        dist.broadcast_object_list(index, src=0, group=self._pg)
        final = self.root / f"step-{step}"
        if self.local_leader:
            write_index(tmp, index[0])
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            fsync_dir(self.root)
        dist.barrier(group=self._pg)
        log.info("checkpoint step-%d sealed in %s", step, final)
        return final

    def _publish(self, final: Path, step: int, meta: dict) -> None:
        """Every rank uploads its own files; rank 0 makes the version visible once all are in."""
        t = self.target
        error = None
        ref = Ref("checkpoint", t.model_name, version_of(t.identity, final))
        upload = self._needs_upload(ref)  # a collective every rank joins, whatever fails inside it
        try:  # whatever fails here, this rank still joins the gather below: no peer waits forever
            mine = own_files(final, self.rank) + ([INDEX] if self.rank == 0 else [])
            if upload is None:
                raise StoreError("rank 0 could not look the version up in the store")
            if upload:
                t.store.upload(ref, {name: final / name for name in mine})
        except Exception as e:
            error = f"rank {self.rank}: {e}"
        errors: list = [None] * self.world
        dist.all_gather_object(errors, error, group=self._pg)
        if self.rank == 0:
            failed = [e for e in errors if e]
            try:
                if failed:
                    raise StoreError("; ".join(failed))
                index = json.loads((final / INDEX).read_text())
                # the manifest holds each file's digest and size; the blocks' digests stay in the index
                files = {name: {"sha256": e["sha256"], "size": e["size"]} for name, e in index["files"].items()}
                entries = {**files, **file_entries(final, [INDEX])}
                t.store.commit(ref, entries, metadata=meta, parents=t.parents, same_content=True)
            except Exception as e:
                self.publish_errors.append(f"{final.name}: {e}")
                log.warning("publishing checkpoint %s failed: %s", final.name, e)
            try:  # the store keeps the newest `keep` of this identity and whatever a lineage names
                apply_retention(t.store, t.model_name, t.identity, self.keep)
            except StoreError as e:
                log.warning("checkpoint retention in %s failed: %s", t.store.description, e)
        self.prune()

    def _needs_upload(self, ref: Ref) -> bool | None:
        """Whether the version must be uploaded: it is not in the store, or (every rank agrees,
        by rank 0's look) its stored bytes do not verify, and rank 0 has quarantined it. None
        when rank 0 could not tell (a store error): every rank still joins the broadcast."""
        verdict = [None]
        if self.rank == 0:
            store = self.target.store
            try:
                verdict = [not store.exists(ref)]
                if not verdict[0] and (problems := store.verify(ref)):
                    store.quarantine(ref, "; ".join(problems[:3]))  # the rerun's bytes replace the dead ones
                    verdict = [True]
            except Exception as e:
                log.warning("cannot look up %s in %s: %s", ref, store.description, e)
                verdict = [None]
        dist.broadcast_object_list(verdict, src=0, group=self._pg)
        return verdict[0]

    def prune(self) -> None:
        """Keep this node's newest `keep` checkpoints (the store keeps its own, by retention)."""
        if self.local_leader:
            for old in local_checkpoints(self.root)[self.keep :]:
                shutil.rmtree(old, ignore_errors=True)


def planned_reads(model, optimizer, rank: int):
    """`reads(path)`: the parts of the checkpoint at `path` that loading it into this rank's
    model and optimizer reads (what resume fetches for this rank)."""

    def reads(path: Path) -> Ranges:
        meta = json.loads((path / "meta.json").read_text())
        return read_ranges(state_dicts(model, optimizer, meta.get(OPTIM_STATE) == FLAT), path, rank)

    return reads


def load(ckpt: Path, model, optimizer, rank: int) -> dict:
    """Load a verified checkpoint into model and optimizer; returns its meta and this rank's state."""
    meta = json.loads((ckpt / "meta.json").read_text())
    flat = meta.get(OPTIM_STATE) == FLAT
    state = state_dicts(model, optimizer, flat)
    load_state(state, ckpt)
    options = StateDictOptions(flatten_optimizer_state_dict=flat)
    weights, optim = state[MODEL_KEY], state["optim"]
    set_state_dict(model, optimizer, model_state_dict=weights, optim_state_dict=optim, options=options)
    rank_file = ckpt / f"rank{rank}.pt"
    rank_state = torch.load(rank_file, weights_only=True) if rank_file.is_file() else {}
    return {"meta": meta, "rank_state": rank_state}
