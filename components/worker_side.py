"""What every launched worker does in its own process, on the replicas' side of a launch
(`components/launcher.py` is the driver's): its typed spec from the command line (`WorkerSpec`,
`worker_spec`), log lines that name its rank, and the `rank_failed` event it logs when an
exception ends it, which the driver reads back (`components/failures.py`)."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import logging
import os
import sys
import time
import typing

from components import events
from components.fleet import NODE_NAMES_ENV, REPLICA_ENV

# A module a worker imports when this is set in its environment and calls `install(...)` on:
# how tests inject faults (a NaN, a dead or slow rank, a degraded node) into real runs.
PLUGIN_ENV = "LIFTOFF_WORKER_PLUGIN"
PLUGIN_ARGS_ENV = "LIFTOFF_WORKER_PLUGIN_ARGS"  # the plugin's own settings (which faults), as JSON

# The event a replica's process logs when an exception ends it (components/events.py): its
# rank, the time (epoch seconds) and the exception. The driver reads it from the replica's log
# stream (all a pod shares with it besides the store) to name the rank that failed first.
RANK_FAILED = "rank_failed"
# what every report of this process adds: where it is (a trainer's node and collective)
REPORT_CONTEXT: list = []


class WorkerSpec:
    """Base of what a stage tells the workers it launches: a dataclass whose fields are plain
    JSON values or config groups. Encoded once, here, into the worker's command line."""

    def to_json(self) -> dict:
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_json(cls, data: dict):
        from components.config import group_from_dict

        groups = {}  # field -> its config group's dataclass (of `Group | None` too)
        for name, hint in typing.get_type_hints(cls).items():
            kinds = [t for t in typing.get_args(hint) or (hint,) if dataclasses.is_dataclass(t)]
            if kinds:
                groups[name] = kinds[0]
        typed = {k: group_from_dict(groups[k], v) for k, v in data.items() if k in groups and v is not None}
        return cls(**{**data, **typed})

    def encode(self) -> str:
        return base64.urlsafe_b64encode(json.dumps(self.to_json()).encode()).decode()

    @classmethod
    def decode(cls, text: str):
        return cls.from_json(json.loads(base64.urlsafe_b64decode(text.encode()).decode()))


def _plain(value):
    from components.config import as_plain_dict, drop_none

    return drop_none(as_plain_dict(value)) if dataclasses.is_dataclass(value) else value


def worker_spec(argv: list[str] | None, spec_type: type[WorkerSpec]):
    """The start of every launched worker: its typed spec from `--spec-b64`, log lines that name
    the rank, and the thread count the launcher chose for this host."""
    import argparse

    import torch

    parser = argparse.ArgumentParser()
    parser.add_argument("--spec-b64", required=True)
    spec = spec_type.decode(parser.parse_args(argv).spec_b64)
    if names := os.environ.get(NODE_NAMES_ENV):  # locally: which of this host's simulated nodes this is
        os.environ["NODE_NAME"] = names.split(",")[int(os.environ[REPLICA_ENV])]
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s rank{os.environ.get('RANK', '?')} %(levelname)s %(name)s: %(message)s",
        stream=sys.stdout,
    )
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    report_uncaught_exceptions()
    return spec


def report_uncaught_exceptions(rank: str | None = None) -> None:
    """An exception that ends this replica's process is first logged as one `rank_failed`
    line (rank, time, type, message), then printed as usual. torch.distributed's own hook,
    installed later, calls this one: it chains."""
    previous = sys.excepthook

    def hook(kind, value, tb):
        report_failure(kind.__name__, str(value), rank)
        previous(kind, value, tb)

    sys.excepthook = hook


def report_failure(kind: str, message: str, rank: str | None = None, stacks_follow: bool = False, **extra) -> dict:
    """One `rank_failed` event for this replica's rank: the launcher ranks failures by its time,
    so a process that ends itself (the watchdog) is named before the peers its exit fails;
    `stacks_follow`: a dump of every thread's stack comes next (log tails keep it whole);
    `extra`: more of the record (a hung rank's collective). The record, or {} when it could not
    be written: never raises, what the caller prints next (a traceback, the stacks) matters more."""
    try:
        rank = rank if rank is not None else os.environ.get("RANK", "?")
        record = {"rank": rank, "time": time.time(), "type": kind, "message": message}
        for context in REPORT_CONTEXT:
            with contextlib.suppress(Exception):  # the report matters more than its context
                record.update(context())
        record.update({"stacks_follow": True} if stacks_follow else {}, **extra)
        logging.getLogger("liftoff.failure").error("%s", events.line(RANK_FAILED, **record))
        return record
    except Exception:
        return {}


def exit_now(code: int) -> typing.NoReturn:
    """End a worker whose main returned: its process group is destroyed, its files closed, what
    it hands back is in the store. The interpreter's own teardown (finalizing the ~3,400 modules
    torch, transformers and torchao load) takes about 1.5 s of a process on this kind of machine,
    on every launch of every stage; skipped, with the streams flushed first. A main
    that raised exits the usual way (its traceback, torchelastic's error file). The registered
    exit handlers still run (logging's flush, temporary directories, a test plugin's hooks): they
    take milliseconds; the modules' finalization is what is skipped."""
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
