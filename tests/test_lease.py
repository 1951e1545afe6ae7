"""The lease per training identity, on both backends: asserted on the lease object in the store
(and on S3 on its object versions), and raced by real processes."""

from __future__ import annotations

import json
import multiprocessing as mp
import threading
import time

import pytest

from components.store import Lease, LeaseHeld, LeaseLost, NotFound, open_store
from components.store.lease import utc_clock
from tests.store_objects import is_s3, object_versions

NAME = "3f2a9c0d11aa4b5c"
KEY = f"_leases/{NAME}.json"


def record(store) -> dict:
    return json.loads(store.backend.get_bytes(KEY))


def held_line(holder: str, expires_at: float) -> str:
    return f"training identity {NAME} is held by {holder} until {utc_clock(expires_at)} UTC; wait for it or stop it"


def test_a_second_holder_gets_lease_held_naming_the_first(store):
    first = Lease(store, NAME, "node-a:4242 (launch 20261202-1141)", ttl_s=60).acquire()
    second = Lease(store, NAME, "node-b:77 (launch 20261202-1142)", ttl_s=60)
    with pytest.raises(LeaseHeld) as e:
        second.acquire()
    assert str(e.value) == held_line("node-a:4242 (launch 20261202-1141)", first.expires_at)
    assert e.value.holder == "node-a:4242 (launch 20261202-1141)" and e.value.expires_at == first.expires_at
    stored = record(store)
    assert stored["holder"] == "node-a:4242 (launch 20261202-1141)" and stored["token"] == first.token
    assert stored["released"] is False and stored["expires_at"] == first.expires_at
    assert not second.held


def test_lease_held_says_the_time_of_day_in_utc():
    expires = time.time() + 60
    line = str(LeaseHeld("training identity", NAME, "h:1", expires))
    clock = time.strftime("%H:%M:%S", time.gmtime(expires))
    assert line == f"training identity {NAME} is held by h:1 until {clock} UTC; wait for it or stop it"


def test_an_expired_lease_is_taken_over_and_its_old_holder_finds_it_lost(store):
    t0 = time.time()
    old = Lease(store, NAME, "node-a:1", ttl_s=10, clock=lambda: t0).acquire()
    with pytest.raises(LeaseHeld):  # not yet expired
        Lease(store, NAME, "node-b:2", ttl_s=10, clock=lambda: t0 + 9).acquire()
    new = Lease(store, NAME, "node-b:2", ttl_s=10, clock=lambda: t0 + 11).acquire()
    assert record(store)["holder"] == "node-b:2" and record(store)["token"] == new.token
    with pytest.raises(LeaseLost) as e:
        old.renew()  # its heartbeat: the lease is not its any more
    assert str(e.value) == (
        f"training identity {NAME}: the lease of node-a:1 was taken over after it expired; "
        f"held by node-b:2 until {utc_clock(t0 + 21)} UTC"
    )
    old.release()  # a lease taken over is not released by its old holder
    assert record(store)["holder"] == "node-b:2" and record(store)["released"] is False


def test_release_lets_the_second_in(store):
    first = Lease(store, NAME, "node-a:1", ttl_s=60).acquire()
    first.release()
    assert record(store)["released"] is True and record(store)["holder"] == "node-a:1"
    second = Lease(store, NAME, "node-b:2", ttl_s=60).acquire()
    assert record(store)["holder"] == "node-b:2" and record(store)["released"] is False
    with pytest.raises(LeaseHeld, match="held by node-b:2"):
        Lease(store, NAME, "node-a:1", ttl_s=60).acquire()
    second.release()


def test_a_waiting_holder_gets_the_lease_when_it_is_released(store):
    first = Lease(store, NAME, "node-a:1", ttl_s=60).acquire()
    threading.Timer(0.5, first.release).start()
    start = time.monotonic()
    second = Lease(store, NAME, "node-b:2", ttl_s=60).acquire(wait_s=20, poll_s=0.1)
    assert 0.4 < time.monotonic() - start < 15 and record(store)["token"] == second.token


def test_hold_renews_every_third_of_the_ttl_and_releases_on_exit(store):
    lease = Lease(store, NAME, "node-a:1", ttl_s=3.0)
    with lease.hold():
        first_expiry = record(store)["expires_at"]
        time.sleep(4.0)  # past the first expiry: only the heartbeat keeps it
        assert record(store)["expires_at"] > first_expiry + 0.5
        with pytest.raises(LeaseHeld, match="held by node-a:1"):
            Lease(store, NAME, "node-b:2", ttl_s=3.0).acquire()
        lease.check()
    assert record(store)["released"] is True and record(store)["token"] == lease.token
    if is_s3(store):  # every heartbeat wrote an object version; release drops the old ones
        assert object_versions(store, KEY) == [(KEY, "current")]


def test_leases_are_no_artifact_kind(store):
    from pipelines.artifacts import known_kinds

    Lease(store, NAME, "node-a:1", ttl_s=60).acquire()
    assert list(store.ls()) == [] and "_leases" not in known_kinds(store)


def _race(cfg, name: str, holder: str, barrier, results) -> None:
    store = open_store(cfg)
    lease = Lease(store, name, holder, ttl_s=60)
    barrier.wait()
    try:
        lease.acquire()
        results.put((holder, "won", holder))
    except LeaseHeld as e:
        results.put((holder, "held", e.holder))


@pytest.mark.parametrize("round_", [0, 1])
def test_processes_racing_for_one_lease_exactly_one_wins(store, store_cfg, round_):
    ctx = mp.get_context("spawn")
    n = 4
    barrier, results = ctx.Barrier(n), ctx.Queue()
    name = f"race-{round_}"
    procs = [ctx.Process(target=_race, args=(store_cfg, name, f"proc-{i}", barrier, results)) for i in range(n)]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    winners = [holder for holder, what, _ in outcomes if what == "won"]
    assert len(winners) == 1, outcomes
    assert all(named == winners[0] for _, what, named in outcomes if what == "held"), outcomes
    assert json.loads(store.backend.get_bytes(f"_leases/{name}.json"))["holder"] == winners[0]


class CheckApart:
    """A backend whose create-if-absent checks, then writes (as moto's server does): two callers
    that overlap both see no object and both write."""

    def __init__(self, inner, callers: int):
        self.inner, self.description = inner, inner.description
        self.barrier = threading.Barrier(callers)
        self.settle_s = 1.0  # far longer than the two writes are apart

    def put_bytes_if_absent(self, key, data):
        try:
            self.inner.get_bytes(key)
            return False
        except NotFound:
            pass
        self.barrier.wait()  # both checked: neither object is there
        self.inner.put_bytes(key, data)
        return True

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_store_that_checks_conditions_apart_still_gives_one_holder(store):
    from components.store import ArtifactStore

    racy = ArtifactStore(CheckApart(store.backend, 2), store.cache_dir)
    outcomes = {}

    def take(holder):
        try:
            Lease(racy, NAME, holder, ttl_s=60).acquire()
            outcomes[holder] = "won"
        except LeaseHeld as e:
            outcomes[holder] = f"held by {e.holder}"

    threads = [threading.Thread(target=take, args=(h,)) for h in ("a:1", "b:2")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    stored = record(store)["holder"]  # the last writer's
    assert outcomes == {stored: "won", ({"a:1", "b:2"} - {stored}).pop(): f"held by {stored}"}
