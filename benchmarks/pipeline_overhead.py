"""pipeline_overhead: wall time of `liftoff run` (the tiny experiment, all five stages through
kfp.local, nothing cached) minus the sum of the stages' own work (each component prints `liftoff-stage NAME
compute_s=...`, measured from after its imports to the end of its work). What remains is
everything a user waits for that is not the stages' work: the CLI, kfp.local's task processes
and executor, artifact passing, and each stage process importing its libraries. (Until
2026-12-01 the stage time included those imports, which flattered the overhead.) Target:
overhead < 25% of the total."""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import CORPUS, report


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        proc = subprocess.run(
            # -v: every stage's own lines (its `liftoff-stage` line among them) on stdout
            [str(Path(sys.executable).parent / "liftoff"), "run", "-v", f"data.paths=[{CORPUS}]"],
            cwd=tmp,
            capture_output=True,
            text=True,
        )
        total = time.perf_counter() - t0
    if proc.returncode:
        print(proc.stdout[-3000:], proc.stderr[-3000:])
        raise SystemExit("liftoff run failed")
    stages = {m[0]: float(m[1]) for m in re.findall(r"liftoff-stage (\w+) compute_s=([\d.]+)", proc.stdout)}
    compute = sum(stages.values())
    print("stage compute: " + ", ".join(f"{k} {v:.1f}s" for k, v in stages.items()))
    print(
        f"total {total:.1f}s, stages {compute:.1f}s, overhead {total - compute:.1f}s ({(total - compute) / total:.0%})"
    )
    report("pipeline_overhead", total - compute, total, "s", stages=stages)


if __name__ == "__main__":
    main()
