"""A training driver whose lease is taken over while its job runs (the lease expired during a
store outage and another run of the identity took it) does not hand the job's result on, and its
replicas publish no model and no run record."""

from __future__ import annotations

import threading

import pytest

from components.store import Lease, LeaseLost, StoreError, open_store
from components.train import stage

OTHER = "other-driver:4242 (launch 20261202-1142)"


def test_a_run_whose_lease_is_taken_over_mid_run_hands_back_no_result(trainer, monkeypatch):
    """The driver's store refuses its writes for a while (its heartbeat cannot renew), its lease
    expires, a second driver of the same identity takes it over; the store comes back and the
    job trains to the end. The first driver must fail with LeaseLost, returning no result, and
    leave the lease to the second."""
    monkeypatch.setattr(stage, "LEASE_TTL_S", 0.5)  # expires within a second of the outage
    outage = threading.Event()
    backend = trainer.store.backend  # the first driver's: the second one opens its own
    replace = backend.replace_bytes_if

    def replace_unless_out(key, expected, data):
        if outage.is_set():
            raise StoreError(f"{key}: store unreachable (test outage)")
        return replace(key, expected, data)

    monkeypatch.setattr(backend, "replace_bytes_if", replace_unless_out)
    run_app, taken = stage.run_app, {}

    def lose_the_lease_then_run(launch):
        outage.set()
        try:  # waits for the first driver's lease to expire, then takes it over
            taken["lease"] = Lease(open_store(trainer.store_cfg), launch.spec.identity, OTHER, ttl_s=600)
            taken["lease"].acquire(wait_s=30, poll_s=0.05)
        finally:
            outage.clear()
        return run_app(launch)  # the job trains on; the first driver's heartbeat finds its lease gone

    monkeypatch.setattr(stage, "run_app", lose_the_lease_then_run)
    handed: list = []
    with pytest.raises(LeaseLost):
        handed.append(
            trainer.run(
                "train.steps=2",
                "train.warmup_steps=1",
                "train.checkpoint_interval=2",
                "model.hidden_size=32",
                "model.ffn_hidden_size=96",
            )
        )
    assert handed == []  # no TrainResult: nothing for the pipeline to take as this run's model
    store = open_store(trainer.store_cfg)
    assert not list(store.ls("model")) and not list(store.ls("run"))  # rank 0 stopped before publishing
    held = taken["lease"].current()  # the lease in the store: the second driver's, not released
    assert held["token"] == taken["lease"].token and held["holder"] == OTHER and held["released"] is False
