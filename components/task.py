"""The opening every KFP component shares: `with stage_task(NAME, group=dict, ...) as task:`
sets up logging, gives the task a directory of its own under `liftoff run` (as its pod has),
checks the groups it was handed as the CLI checks them (a UI-edited run included) and opens
the store on first use; on leaving the block it prints the stage's own compute time as one
`compute_line`, which benchmarks/pipeline_overhead.py reads (with `STAGE_LINE`, from here)."""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
STAGE_LINE = re.compile(r"liftoff-stage ([\w-]+) compute_s=([\d.]+)")


def compute_line(name: str, seconds: float) -> str:
    return f"liftoff-stage {name} compute_s={seconds:.3f}"


@dataclass
class Task:
    name: str
    groups: dict = field(default_factory=dict)  # the checked config groups, by name

    @functools.cached_property
    def store(self):
        from components.store import open_store

        return open_store(self.groups["store"])


@contextlib.contextmanager
def stage_task(name: str, directory: str | None = None, **groups: dict) -> Iterator[Task]:
    """`name`: the stage as benchmarks count it; `directory`: its task directory (a shard's own)."""
    from components.config import checked_groups
    from components.local_pod import enter_task_directory

    started = time.perf_counter()  # the stage's own work, after its imports (those are overhead)
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    enter_task_directory(directory or name)  # under `liftoff run`: a directory of its own
    task = Task(name, checked_groups(**groups))
    yield task
    print(compute_line(name, time.perf_counter() - started), flush=True)
