"""Whether the store's conditional writes behave, tried live: what the run lease (lease.py) rests on.

Under a key of its own (`_doctor/<uuid>/probe`) the probe creates an object only if absent, tries
that again (which must be refused), replaces it against a made-up ETag (refused) and against the
current one (done, and the new bytes read back), then removes every version under the key. A
store that ignores `If-None-Match` lets two runs acquire one training identity's lease; one that
refuses every `If-Match` loses a held lease at its first heartbeat. SeaweedFS before 4.08 does
both on a versioned bucket (seaweedfs#8073, fixed by seaweedfs#8080). The local backend has no
ETags: its stale replace compares against bytes the object does not hold.

One writer, one step at a time: a store that checks a condition apart from the write (two
overlapping writers both told they won) passes; the lease's read-back (`settle_s`) covers that.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from components.store.keys import StoreError

PREFIX = "_doctor"  # store-internal, like `_leases`: no artifact kind
MADE_UP_ETAG = '"00000000000000000000000000000000"'


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    found: str  # what the probe saw: the steps that behaved, or the one that did not and why it matters


def _stale_replace(backend, key: str, data: bytes) -> bool:
    """A replace the store must refuse: If-Match a made-up ETag (S3), or (local) a compare
    against bytes the object does not hold."""
    if hasattr(backend, "put_bytes_if_etag"):
        return backend.put_bytes_if_etag(key, data, MADE_UP_ETAG)
    return backend.replace_bytes_if(key, b"bytes the probe never wrote", data)


def _steps(backend, key: str) -> str | None:
    """The probe's steps in order; the first that misbehaves, with what that does to the lease."""
    first, second, stale, new = b"first", b"second", b"stale", b"replaced"
    if not backend.put_bytes_if_absent(key, first):
        return "a conditional create (If-None-Match: *) of a new key was refused: no run could take its lease"
    if backend.put_bytes_if_absent(key, second):
        return (
            "a second If-None-Match: * create succeeded over an existing object: the store ignores "
            "If-None-Match, so two runs of one training identity could both take its lease"
        )
    if _stale_replace(backend, key, stale):
        return (
            f"a replace with a stale ETag (If-Match: {MADE_UP_ETAG}) succeeded: the store ignores If-Match, "
            "so a run whose lease was taken over would keep renewing it"
        )
    if not backend.replace_bytes_if(key, first, new):
        return (
            "a replace with the object's current ETag (If-Match) was refused: a held lease would be lost "
            "at its first heartbeat"
        )
    if (back := backend.get_bytes(key)) != new:
        return f"after a conditional replace the object reads back {back[:40]!r}, not the bytes written"
    return None


def probe_conditional_writes(backend) -> ProbeResult:
    """Try the store's conditional writes under a fresh key, then remove every version of it."""
    where = f"{PREFIX}/{uuid.uuid4().hex}"
    key = f"{where}/probe"
    failed = None
    try:
        failed = _steps(backend, key)
    except StoreError as e:
        failed = f"the probe could not write {key}: {e}"
    finally:
        try:
            backend.purge(where)
        except StoreError as e:
            failed = failed or f"the probe's object {key} could not be removed (remove it by hand): {e}"
    if failed:
        return ProbeResult(False, failed)
    return ProbeResult(
        True,
        "create-if-absent done, a second refused; If-Match a made-up ETag refused, the current one "
        "replaced and read back; the probe object removed",
    )
