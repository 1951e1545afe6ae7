"""Typed events a stage's processes hand to whoever drives them, through the one channel a
pod shares with its driver both locally and on a cluster: its output stream. An event is one
line, `liftoff-event {"kind": ..., ...}`, written by `emit` and read back by `parse`, here and
nowhere else: no module reads another's log text, so the log lines people read can change
without the CLI, the launcher or a benchmark noticing.

The kinds: `training` (what trains, once), `step` (a logged training step), `relaunch` (a
job relaunched after a failure), `compute` (a stage's own compute time), `failed` (the
exception a stage ended with)."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field

MARK = "liftoff-event "


@dataclass(frozen=True)
class Event:
    kind: str
    fields: dict = field(default_factory=dict)

    def __getitem__(self, key: str):
        return self.fields[key]

    def get(self, key: str, default=None):
        return self.fields.get(key, default)


def strict(value):
    """Strict JSON: a NaN or infinity travels as None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [strict(v) for v in value]
    return value


def line(kind: str, **fields) -> str:
    return MARK + json.dumps(strict({"kind": kind, **fields}), default=str, allow_nan=False)


def emit(kind: str, **fields) -> None:
    """Write one event on stdout (flushed: a driver streaming the log sees it now)."""
    print(line(kind, **fields), file=sys.stdout, flush=True)


def parse(text: str) -> Event | None:
    """The event a line carries, wherever a launcher's or kfp.local's prefix put it; None for
    every other line (a truncated or foreign one included)."""
    at = text.find(MARK)
    if at < 0:
        return None
    try:
        record = json.loads(text[at + len(MARK) :])
    except (ValueError, RecursionError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("kind"), str):
        return None
    kind = record.pop("kind")
    return Event(kind, record)


def events(lines, kind: str | None = None) -> list[Event]:
    """The events among `lines` (of one kind, when given), in order."""
    found = (parse(ln) for ln in lines)
    return [e for e in found if e is not None and (kind is None or e.kind == kind)]


def failure_fields(exc: BaseException) -> dict:
    """A stage's exception as the `failed` event carries it: its type and its cause in one line
    (an exception may give it as `summary`; else its message's lines joined: `a: b; c`)."""
    summary = getattr(exc, "summary", None)
    return {"type": type(exc).__name__, "message": summary or one_line(str(exc)) or type(exc).__name__}


def one_line(text: str) -> str:
    """A message's lines as one: `a:` then its indented items `b; c`."""
    parts = [ln.strip().removeprefix("- ") for ln in text.strip().splitlines() if ln.strip()]
    if not parts:
        return text.strip()
    out = parts[0]
    for i, part in enumerate(parts[1:]):
        out += (" " if i == 0 and out.endswith(":") else "; ") + part
    return out
