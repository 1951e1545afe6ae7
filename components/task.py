"""The opening every KFP component shares: `with stage_task(NAME, group=dict, ...) as task:`
sets up logging, gives the task a directory of its own under `liftoff run` (as its pod has),
checks the groups it was handed as the CLI checks them (a UI-edited run included) and opens
the store on first use; on leaving the block it hands back the stage's own compute time as a
`compute` event (benchmarks/pipeline_overhead.py reads it), or the exception it ended with as a
`failed` event (what `liftoff run` prints of a failed stage)."""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from components import events

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


@dataclass
class Task:
    name: str
    groups: dict = field(default_factory=dict)  # the checked config groups, by name

    @functools.cached_property
    def store(self):
        from components.store import open_store

        return open_store(self.groups["store"])


def input_ref(artifact) -> str:
    """The store reference an upstream stage's artifact points at (its file is `{"ref": ...}`)."""
    import json
    from pathlib import Path

    return json.loads(Path(artifact.path).read_text())["ref"]


def executor_output_file() -> str | None:
    """The file KFP's executor writes the task's outputs to (its `--executor_input`); None
    outside a KFP executor."""
    import json
    import sys

    argv = sys.argv
    for i, arg in enumerate(argv[:-1]):
        if arg == "--executor_input":
            try:
                return json.loads(argv[i + 1])["outputs"]["outputFile"]
            except (ValueError, KeyError, TypeError):
                return None
    return None


def exit_once_written() -> None:
    """After a task's work succeeded: once KFP's executor has written its outputs and returns,
    its process ends without the interpreter's module teardown (unloading torch and transformers
    takes about 1.5 s of every task's process; the exit handlers still run). Only then: an
    exception after this point (the executor's own) goes through sys.excepthook and the process
    exits as usual, non-zero. (A `sys.exit(n)` would not: kfp's executor_main never calls it.)"""
    import atexit
    import sys
    from pathlib import Path

    from components.worker_side import exit_now

    output = executor_output_file()
    if output is None:
        return
    raised: list[bool] = []
    previous = sys.excepthook

    def hook(*exc) -> None:
        raised.append(True)
        previous(*exc)

    def done() -> None:  # the last atexit handler registered: the first to run
        if not raised and Path(output).is_file():
            atexit.unregister(done)
            exit_now(0)  # every other exit handler still runs; what is skipped: finalizing the modules

    sys.excepthook = hook
    atexit.register(done)


@contextlib.contextmanager
def stage_task(name: str, directory: str | None = None, **groups: dict) -> Iterator[Task]:
    """`name`: the stage as benchmarks count it; `directory`: its task directory (a shard's own)."""
    from components.config import checked_groups
    from components.local_pod import enter_task_directory

    started = time.perf_counter()  # the stage's own work, after its imports (those are overhead)
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    try:
        enter_task_directory(directory or name)  # under `liftoff run`: a directory of its own
        yield Task(name, checked_groups(**groups))
    except BaseException as e:
        events.emit("failed", stage=name, **events.failure_fields(e))
        raise
    events.emit("compute", stage=name, seconds=round(time.perf_counter() - started, 3))
    exit_once_written()
