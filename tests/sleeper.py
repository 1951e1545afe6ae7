"""A worker that only records its pid and waits: for tests of the launcher's lifecycle."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from components.worker_side import WorkerSpec, worker_spec


@dataclass(frozen=True)
class SleeperSpec(WorkerSpec):
    pid_dir: str


if __name__ == "__main__":
    spec = worker_spec(sys.argv[1:], SleeperSpec)
    Path(spec.pid_dir, f"{os.getpid()}.pid").write_text(str(os.getpid()))
    while True:
        time.sleep(1)
