"""A worker that records what its "pod" looks like (directory, environment) and exits."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from components.config import StoreConfig
from components.worker_side import WorkerSpec, worker_spec


@dataclass(frozen=True)
class ProbeSpec(WorkerSpec):
    store: StoreConfig
    driver_file: str  # a path on the driver's disk, which the pod must not see


if __name__ == "__main__":
    spec = worker_spec(sys.argv[1:], ProbeSpec)
    seen = {"cwd": os.getcwd(), "env": dict(os.environ), "driver_dir_visible": Path(spec.driver_file).exists()}
    Path(f"pod-{os.environ['RANK']}.json").write_text(json.dumps(seen))
