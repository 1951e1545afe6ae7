"""Atomic, verifiable, resumable checkpoints with torch.distributed.checkpoint (DCP).

A checkpoint is written to `step-N.tmp/`: DCP shards of model and optimizer, one
`rank{r}.pt` per rank (RNG states, tensors only), `meta.json` (step, global samples consumed, loss,
identity, model shape), then `checkpoint.json` with the sha256 of every file; the files are
fsynced and the directory renamed to `step-N/`. Only a renamed directory whose
checkpoint.json verifies is ever resumed from. Loading unpickles nothing but an allowlist.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException as DcpCheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from components.checkpoint_format import (
    CheckpointError,
    SafeFileSystemReader,
    fsync_dir,
    local_checkpoints,
    write_index,
)

log = logging.getLogger(__name__)


class Checkpointer:
    """Saves step-N checkpoints. Synchronous saves block until the checkpoint is indexed and
    renamed. Asynchronous saves block only while DCP stages the state; once every rank's
    writes are done, rank 0 indexes (hashes), renames and publishes in a background thread."""

    def __init__(
        self,
        root: Path,
        keep: int,
        async_save: bool,
        rank: int,
        on_finished: Callable[[Path, dict], None] | None = None,
    ):
        self.root, self.keep, self.async_save, self.rank = root, keep, async_save, rank
        self.on_finished = on_finished
        self._pending: tuple | None = None  # (future, tmp dir, step, meta) of an async save
        self._finalizer: threading.Thread | None = None
        self._finalize_error: BaseException | None = None
        self._pg = dist.new_group(backend="gloo")  # saves run collectives off the training stream
        root.mkdir(parents=True, exist_ok=True)

    def save(self, step: int, model, optimizer, meta: dict, rank_state: dict) -> None:
        self.wait()
        tmp = self.root / f"step-{step}.tmp"
        if self.rank == 0 and tmp.exists():
            shutil.rmtree(tmp)  # left by a process killed mid-save; never resumed from
        dist.barrier(group=self._pg)
        with self._no_partial(tmp, step):
            tmp.mkdir(parents=True, exist_ok=True)
            model_sd, optim_sd = get_state_dict(model, optimizer)
            state = {"model": model_sd, "optim": optim_sd}
            torch.save(rank_state, tmp / f"rank{self.rank}.pt")
            writer = FileSystemWriter(str(tmp), sync_files=True)
            if self.async_save:
                future = dcp.async_save(state, storage_writer=writer, process_group=self._pg)
                self._pending = (future, tmp, step, meta)
                return
            dcp.save(state, storage_writer=writer, process_group=self._pg)
            dist.barrier(group=self._pg)
            if self.rank == 0:
                self._finalize(tmp, step, meta)
        dist.barrier(group=self._pg)

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

    def finish_pending(self, all_ranks_done: bool = False) -> None:
        """Complete an async save: wait for this rank's writes and, unless the step's
        agreement already showed that every rank's are done, for the other ranks'; then rank 0
        finalizes it in the background."""
        if self._pending is None:
            return
        future, tmp, step, meta = self._pending
        self._pending = None
        with self._no_partial(tmp, step):
            future.result()
        if not all_ranks_done:
            dist.barrier(group=self._pg)
        if self.rank == 0:
            self._finalizer = threading.Thread(
                target=self._finalize_in_background, args=(tmp, step, meta), name=f"finalize-step-{step}"
            )
            self._finalizer.start()

    def wait(self) -> None:
        """Every save started so far is on disk, indexed and renamed (or its error raised)."""
        self.finish_pending()
        if self._finalizer is not None:
            self._finalizer.join()
            self._finalizer = None
        if self._finalize_error is not None:
            error, self._finalize_error = self._finalize_error, None
            raise error

    def _finalize_in_background(self, tmp: Path, step: int, meta: dict) -> None:
        try:
            with self._no_partial(tmp, step):
                self._finalize(tmp, step, meta)
        except CheckpointError as e:
            self._finalize_error = e

    def _finalize(self, tmp: Path, step: int, meta: dict) -> None:
        """Rank 0, once every rank's files are written: index, fsync, rename, publish, prune."""
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        write_index(tmp, meta)
        final = self.root / f"step-{step}"
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(self.root)
        log.info("checkpoint step-%d saved to %s", step, final)
        if self.on_finished:
            self.on_finished(final, meta)
        self.prune()

    def prune(self) -> None:
        """Keep the newest `keep` checkpoints; one still being published waits for a later prune."""
        busy = getattr(self.on_finished, "in_flight", set())
        for old in local_checkpoints(self.root)[self.keep :]:
            if old not in busy:
                shutil.rmtree(old, ignore_errors=True)


def load(ckpt: Path, model, optimizer, rank: int) -> dict:
    """Load a verified checkpoint into model and optimizer; returns its meta and this rank's state."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, storage_reader=SafeFileSystemReader(str(ckpt)))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    meta = json.loads((ckpt / "meta.json").read_text())
    rank_file = ckpt / f"rank{rank}.pt"
    rank_state = torch.load(rank_file, weights_only=True) if rank_file.is_file() else {}
    return {"meta": meta, "rank_state": rank_state}


class BackgroundPublisher:
    """Publishes finished checkpoints to the store off the training thread, in order."""

    def __init__(self, publish: Callable[[Path, dict], None]):
        self._publish = publish
        self._threads: list[threading.Thread] = []
        self.in_flight: set[Path] = set()  # not pruned until published
        self.errors: list[str] = []

    def __call__(self, path: Path, meta: dict) -> None:
        self.in_flight.add(path)
        previous = self._threads[-1] if self._threads else None

        def run() -> None:
            if previous is not None:
                previous.join()
            try:
                self._publish(path, meta)
            except Exception as e:  # reported at the end of training, never kills it
                self.errors.append(f"{path.name}: {e}")
                log.warning("publishing checkpoint %s failed: %s", path.name, e)
            finally:
                self.in_flight.discard(path)

        t = threading.Thread(target=run, name=f"publish-{path.name}", daemon=True)
        t.start()
        self._threads.append(t)

    def join(self) -> None:
        for t in self._threads:
            t.join()
