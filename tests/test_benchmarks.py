"""The benchmark scripts' own behaviour where no measurement can run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_benchmark_without_cuda_prints_one_line_saying_so_and_exits_0():
    """`python -m benchmarks.gpu` on a machine without CUDA (hidden here even where there is one)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, proc.stdout
    line = json.loads(lines[0])
    assert line["name"] == "gpu" and "no CUDA device" in line["skipped"]
    assert "value" not in line and "ratio" not in line  # no measurement is reported as one
