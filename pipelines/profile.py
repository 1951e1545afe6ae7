"""`liftoff profile [RUN] [--steps N]`: ask a running training to trace N steps, wait for the
`profile` artifact it publishes (components/train/profiler.py) and say where it is."""

from __future__ import annotations

import json
import time

from components.store import ArtifactStore, NotFound
from components.store.keys import LEASES
from components.store.lease import default_holder
from components.train.profiler import ask, read_request


class ProfileError(ValueError):
    """No such running training, or no profile in time: one line."""


def running_trainings(store: ArtifactStore, now: float | None = None) -> dict[str, dict]:
    """identity -> lease record of every training that holds a live lease in this store."""
    now = time.time() if now is None else now
    live = {}
    for path in store.backend.list_sizes(LEASES):
        name = path.removesuffix(".json")
        try:
            record = json.loads(store.backend.get_bytes(f"{LEASES}/{path}"))
        except (NotFound, ValueError):
            continue
        if not record.get("released") and float(record.get("expires_at", 0)) > now:
            live[name] = record
    return live


def resolve_run(store: ArtifactStore, run: str | None) -> str:
    """The identity of the running training RUN names: its identity or a prefix of it, the train
    job's name (`train-<8 hex>`) or a `run/` or `model/` ref; the only one when RUN is omitted."""
    live = running_trainings(store)
    if not live:
        raise ProfileError(f"no training is running in {store.description} (none holds a live lease)")
    if run is None:
        if len(live) > 1:
            raise ProfileError(f"{len(live)} trainings are running; name one: {', '.join(sorted(live))}")
        return next(iter(live))
    text = run.split("/", 1)[-1] if run.startswith(("run/", "model/")) else run.removeprefix("train-")
    text = text.split("@")[-1] if run.startswith("model/") else text.split("@")[0]
    matches = [identity for identity in live if identity.startswith(text[:16])]
    if len(matches) != 1:
        known = ", ".join(sorted(live))
        raise ProfileError(f"{run!r} names {len(matches)} of the running trainings ({known})")
    return matches[0]


def profile(store: ArtifactStore, run: str | None, steps: int, timeout_s: float, poll_s: float = 1.0) -> str:
    """Request the profile and wait until the training has published it: its ref."""
    identity = resolve_run(store, run)
    request = ask(store, identity, steps, default_holder())
    print(f"asked training {identity} to profile {steps} step(s) (request {request['id']})", flush=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        seen, _ = read_request(store, identity)
        if seen is not None and seen.get("id") == request["id"] and seen.get("served"):
            return seen["served"]
        if identity not in running_trainings(store):
            raise ProfileError(f"training {identity} ended before it served the profile request")
        time.sleep(poll_s)
    raise ProfileError(
        f"no profile from training {identity} within {timeout_s:.0f} s: it looks for requests every "
        "train.profile_poll_steps steps; the request stays, a later poll still serves it"
    )
