"""A lease in the store: one holder at a time per name (one run per training identity per store).

The lease is one small object, `_leases/<name>.json`: {holder, token, acquired, expires_at,
released}. Every change is a conditional write, so two processes never both believe they hold
it:

- `acquire` creates the object only if it is absent (local: a hard link, which fails when the
  name exists; S3: PutObject with `If-None-Match: *`); when it is there and expired or released,
  it takes it over with a compare-and-swap on the bytes it read (local: under an flock; S3:
  PutObject with `If-Match: <ETag of what was read>`). A live lease of another holder is
  `LeaseHeld`, naming the holder and its expiry (after waiting up to `wait_s` for it to end).
- `renew` (the heartbeat) extends the expiry by `ttl_s`, by compare-and-swap on the bytes it
  last wrote: if anyone took the lease over meanwhile (it had expired), `LeaseLost`.
- `release` marks it released (compare-and-swap again: a lease someone took over is theirs) and
  drops the object's earlier versions on a versioned bucket (every heartbeat wrote one).
- `hold()` acquires, renews every ttl/3 in a background thread and releases on exit.

The race, and what closes it: MinIO and S3 check a write's precondition atomically with the
write. moto's server (the tests' S3) checks it before writing, unlocked, so two writers that
overlap by microseconds can both be told they won. A backend declares `settle_s` (0 locally,
0.5 s on S3): after a winning write the lease waits that long and reads the object back; only the
holder whose bytes are there holds it (last writer wins, and every earlier one sees it lost). That
leaves a window only for a writer whose request stalls inside the server for longer than
`settle_s` between its check and its write.

Expiry is wall-clock time (`time.time()`), compared across hosts: their clocks must agree to well
within `ttl_s`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timezone

from components.store.artifacts import ArtifactStore
from components.store.keys import LEASES, NotFound, StoreError, check_part

log = logging.getLogger(__name__)


def utc_clock(epoch: float) -> str:
    """`11:42:10` today (UTC), else `2026-12-03 11:42:10`."""
    stamp = datetime.fromtimestamp(epoch, timezone.utc)
    today = datetime.now(timezone.utc).date()
    return stamp.strftime("%H:%M:%S" if stamp.date() == today else "%Y-%m-%d %H:%M:%S")


class LeaseHeld(StoreError):
    """Another holder's live lease: the message names it and when it expires."""

    def __init__(self, what: str, name: str, holder: str, expires_at: float):
        self.name, self.holder, self.expires_at = name, holder, expires_at
        super().__init__(f"{what} {name} is held by {holder} until {utc_clock(expires_at)} UTC; wait for it or stop it")


class LeaseLost(StoreError):
    """Our lease was taken over (it had expired before a heartbeat renewed it)."""


def default_holder(launch: str | None = None) -> str:
    """`host:pid`, with ` (launch ID)` when given: who holds a lease, for people."""
    who = f"{socket.gethostname()}:{os.getpid()}"
    return f"{who} (launch {launch})" if launch else who


def check_held_by_launch(store: ArtifactStore, name: str, launch: str, what: str = "training identity") -> None:
    """LeaseLost unless lease `name` in the store is held, unreleased, by launch `launch`'s
    driver (`default_holder(launch)`): what a replica checks before it publishes a run's
    result, so a run whose driver lost the lease to another run publishes no model."""
    lease = Lease(store, name, default_holder(launch), ttl_s=1.0, what=what)
    record = lease.current()
    if record is None or record["released"] or not record["holder"].endswith(f"(launch {launch})"):
        holder = record["holder"] if record else "nobody"
        raise LeaseLost(f"{what} {name}: the lease is no longer this run's (held by {holder}); not publishing")


class Lease:
    def __init__(
        self,
        store: ArtifactStore,
        key_name: str,
        holder: str,
        ttl_s: float,
        what: str = "training identity",
        settle_s: float | None = None,
        clock: Callable[[], float] = time.time,
    ):
        if not ttl_s > 0:
            raise ValueError(f"lease ttl_s={ttl_s!r}: must be > 0")
        self.store, self.name, self.holder = store, check_part(key_name, "lease name"), holder
        self.ttl_s, self.what = ttl_s, what
        self.key = f"{LEASES}/{self.name}.json"
        self.settle_s = getattr(store.backend, "settle_s", 0.0) if settle_s is None else settle_s
        self.clock = clock
        self.token = uuid.uuid4().hex
        self.expires_at = 0.0
        self.lost: LeaseLost | None = None  # set by hold()'s heartbeat
        self._raw: bytes | None = None  # what we last wrote: the compare of our compare-and-swaps
        self._renewals = 0
        self._acquired = 0.0

    @property
    def backend(self):
        return self.store.backend

    def _encode(self, expires_at: float, released: bool = False) -> bytes:
        return json.dumps(
            {
                "holder": self.holder,
                "token": self.token,
                "acquired": self._acquired or self.clock(),
                "expires_at": expires_at,
                "expires": datetime.fromtimestamp(expires_at, timezone.utc).isoformat(timespec="seconds"),
                "released": released,
            },
            sort_keys=True,
        ).encode()

    @staticmethod
    def _decode(raw: bytes) -> dict | None:
        try:
            d = json.loads(raw)
            float(d["expires_at"]), str(d["holder"]), str(d["token"])
            return d
        except (ValueError, KeyError, TypeError):
            return None  # unreadable: nobody can hold it; taken over like an expired one

    def current(self) -> dict | None:
        """The lease record in the store now (None when there is none or it is unreadable)."""
        try:
            return self._decode(self.backend.get_bytes(self.key))
        except NotFound:
            return None

    @property
    def held(self) -> bool:
        return self._raw is not None

    def _try(self) -> dict | None:
        """One attempt: None when we hold it now, else the live record of who does."""
        now = self.clock()
        mine = self._encode(now + self.ttl_s)
        if self.backend.put_bytes_if_absent(self.key, mine):
            return self._confirm(mine)
        try:
            raw = self.backend.get_bytes(self.key)
        except NotFound:
            return {}  # released and removed in between: try again
        cur = self._decode(raw)
        if cur is not None and cur["token"] == self.token:  # ours (a retried write that went through)
            self._raw = raw
            self.renew()
            return None
        if cur is None or cur.get("released") or float(cur["expires_at"]) <= now:
            if self.backend.replace_bytes_if(self.key, raw, mine):
                if cur is not None and not cur.get("released"):
                    log.warning("took over the expired lease on %s %s from %s", self.what, self.name, cur["holder"])
                return self._confirm(mine)
            return {}  # someone else changed it first: look again
        return cur

    def _confirm(self, mine: bytes) -> dict | None:
        """After a winning write: on a store whose conditions may not be atomic, wait and read
        back; the lease is ours only if our bytes are still what it holds."""
        if self.settle_s > 0:
            time.sleep(self.settle_s)
            try:
                back = self.backend.get_bytes(self.key)
            except NotFound:
                return {}
            if back != mine:  # another writer's bytes won: theirs if live, else look again
                other = self._decode(back)
                live = other and not other.get("released") and float(other["expires_at"]) > self.clock()
                return other if live else {}
        self._raw = mine
        self.expires_at, self._acquired = json.loads(mine)["expires_at"], json.loads(mine)["acquired"]
        self.lost = None
        log.info("%s %s: lease held by %s until %s UTC", self.what, self.name, self.holder, utc_clock(self.expires_at))
        return None

    def acquire(self, wait_s: float = 0.0, poll_s: float | None = None) -> Lease:
        """Hold the lease, waiting up to wait_s for a live one of another holder to end; then
        LeaseHeld naming that holder and its expiry."""
        deadline = self.clock() + wait_s
        poll = poll_s if poll_s is not None else max(0.05, min(5.0, self.ttl_s / 10))
        races = 0
        while True:
            other = self._try()
            if other is None:
                return self
            if other:  # a live lease of someone else
                left = deadline - self.clock()
                if left <= 0:
                    raise LeaseHeld(self.what, self.name, other["holder"], float(other["expires_at"]))
                time.sleep(min(poll, left))
            else:  # lost a race to change it: look again at once, a few times, then back off
                races += 1
                time.sleep(0 if races < 3 else min(poll, 0.05 * races))

    def renew(self) -> None:
        """The heartbeat: extend our lease to now + ttl_s. LeaseLost when it is not ours any more."""
        if self._raw is None:
            raise LeaseLost(f"{self.what} {self.name}: no lease held by {self.holder} to renew")
        new = self._encode(self.clock() + self.ttl_s)
        if not self.backend.replace_bytes_if(self.key, self._raw, new):
            self._raw = None
            cur = self.current()
            now_held = (
                f"held by {cur['holder']} until {utc_clock(float(cur['expires_at']))} UTC"
                if cur and not cur.get("released")
                else "no longer held"
            )
            raise LeaseLost(
                f"{self.what} {self.name}: the lease of {self.holder} was taken over after it expired; {now_held}"
            )
        self._raw = new
        self.expires_at = json.loads(new)["expires_at"]
        self._renewals += 1
        if self._renewals % 100 == 0:
            self._drop_history()

    def release(self) -> None:
        """Give the lease up (a no-op when it is not ours any more)."""
        if self._raw is None:
            return
        done = self.backend.replace_bytes_if(self.key, self._raw, self._encode(self.clock(), released=True))
        self._raw = None
        if not done:
            log.warning("%s %s: lease of %s was taken over before it was released", self.what, self.name, self.holder)
        self._drop_history()

    def _drop_history(self) -> None:
        try:
            self.backend.drop_history(self.key)
        except StoreError as e:  # housekeeping only
            log.warning("could not drop the old versions of %s: %s", self.key, e)

    @contextlib.contextmanager
    def hold(self, wait_s: float = 0.0) -> Iterator[Lease]:
        """Acquire; renew every ttl/3 in a daemon thread; release on exit. A heartbeat that finds
        the lease taken over stops and leaves the LeaseLost in `lost` (see `check`); a store
        error in a heartbeat is logged and retried at the next beat."""
        self.acquire(wait_s)
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(self.ttl_s / 3):
                try:
                    self.renew()
                except LeaseLost as e:
                    self.lost = e
                    log.error("%s", e)
                    return
                except StoreError as e:
                    log.warning("%s %s: lease heartbeat failed (%s); retrying", self.what, self.name, e)

        thread = threading.Thread(target=beat, name=f"lease-{self.name[:12]}", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            stop.set()
            thread.join()
            self.release()

    def check(self) -> None:
        """Raise the LeaseLost a heartbeat found, if any."""
        if self.lost is not None:
            raise self.lost
