"""Going back to a checkpoint while training: the weights and optimizer only (non-finite
steps: the data goes on), or a rewind of everything a checkpoint carries (step, data
position, RNG, loss scale, history, recent losses) for a loss spike or a silent data
corruption. The same restore serves a resume. And the record that keeps a node out of the
next launch, written by rank 0 for a rank's node."""

from __future__ import annotations

import logging

import torch

from components import checkpoint_format, fleet
from components.train import checkpoint as ckpt
from components.train.guards import GuardHalt
from components.train.job import Job, TrainState
from components.train.resume import Resumed, find_resume_checkpoint

log = logging.getLogger("liftoff.train")


def restore_state(job: Job, state: TrainState, found: Resumed, loaded: dict) -> None:
    """Everything but the weights a checkpoint carries, into the job and the loop's state."""
    meta = loaded["meta"]
    job.monitor.restore_history(found.path / checkpoint_format.HISTORY)
    state.step, state.samples, state.skipped = meta["step"], meta["samples"], meta.get("skipped_steps", 0)
    state.skip_windows = [list(w) for w in meta.get("skipped_samples", [])]
    state.bad_in_row = state.spikes_in_row = 0
    state.spike_row = []
    job.guards.restore(meta.get("recent_losses"))
    if "rng" in loaded["rank_state"]:
        torch.set_rng_state(loaded["rank_state"]["rng"])
    if job.scaler is not None and "scaler_scale" in meta:
        job.scaler.load_state_dict({**job.scaler.state_dict(), "scale": meta["scaler_scale"]})


def roll_back(job: Job, state: TrainState, max_step: int, why: str, rewind: bool) -> Resumed:
    """Load the newest stored checkpoint at or before `max_step` that verifies (this run's
    own first, then a seed's), as resume chooses it. `rewind`: the step, data position and
    history go back with it; else only the weights and optimizer do."""
    job.checkpointer.wait()  # a save in flight is published (or failed) first
    mode = "auto" if job.train.resume == "never" else job.train.resume
    reads = ckpt.planned_reads(job.model, job.optimizer, job.rank)
    target = find_resume_checkpoint(
        mode, job.ckpt_root, job.store, job.model_cfg, job.identity, job.rank, max_step, reads
    )
    if target is None:
        raise GuardHalt(f"{why}, and no checkpoint at or before step {max_step} to roll back to")
    loaded = ckpt.load(target.path, job.model, job.optimizer, job.rank)
    if rewind:
        skipped = state.skip_windows  # this run's windows, a superset of the checkpoint's
        restore_state(job, state, target, loaded)
        state.skip_windows = skipped
    job.recipe.after_optimizer_step(job.model, job.train, job.fsdp)  # scales of the loaded weights
    job.watchdog.beat()
    log.warning("%s: rolled back to %s", why, target.ref)
    return target


def quarantine_rank(job: Job, rank: int, source: str, reason: str, evidence: dict) -> bool:
    """Rank 0 records the node of `rank` as quarantined (the next launch keeps off it), once
    per run; a store that cannot take it is logged and training goes on."""
    host = job.monitor.hosts[rank]
    if job.rank != 0 or job.spec.quarantine_ttl_s <= 0 or host in job.quarantined:
        return False
    try:
        fleet.quarantine(job.store, host, source, reason, job.spec.quarantine_ttl_s, evidence)
    except Exception as e:
        log.warning("could not quarantine node %s (%s): %s", host, reason, e)
        return False
    job.quarantined.add(host)
    log.warning("quarantined node %s: %s", host, reason)
    return True
