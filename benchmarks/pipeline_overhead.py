"""pipeline_overhead: wall time of `liftoff run` (the tiny experiment, all five stages through
kfp.local, nothing cached) minus the stages' own work (each task hands back a `compute`
event (components/events.py), measured from after its imports to the end of its work). What remains is
everything a user waits for that is not the stages' work: the CLI, kfp.local's task processes
and executor, artifact passing, and each task process importing its libraries. (Until
2026-12-01 the stage time included those imports, which flattered the overhead.) Target:
overhead < 25% of the total.

Tokenize is three kinds of task (tokenize-plan, one tokenize-shard per source partition,
tokenize-merge). The shard tasks run side by side (`data.parallelism` at a time), so their work
on the wall clock is counted as max(slowest shard, sum / parallelism): the least time those
shards can have taken, so concurrent work is never counted twice and the overhead is never
flattered. Every stage must report its line, or the benchmark fails (a line it cannot match
would otherwise count that stage's work as overhead).

`python -m benchmarks.pipeline_overhead [OVERRIDE ...]`: overrides go to `liftoff run`
(e.g. `data.shards=4` for the fanned-out tokenize)."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import CORPUS, report
from components import events

SEQUENTIAL = ("tokenize-plan", "tokenize-merge", "preflight", "train", "validate", "evaluate")
PARALLEL = "tokenize-shard"  # one task per source partition, `data.parallelism` at a time


def stage_work(stdout: str, parallelism: int) -> tuple[dict[str, float], list[float]]:
    """({stage: its work on the wall clock}, the shard tasks' own compute_s) from a run's output.
    Raises SystemExit naming any stage that handed back no `compute` event, or an unknown one."""
    seen: dict[str, list[float]] = {}
    for e in events.events(stdout.splitlines(), "compute"):
        seen.setdefault(e["stage"], []).append(float(e["seconds"]))
    missing = [n for n in (*SEQUENTIAL, PARALLEL) if n not in seen]
    unknown = [n for n in seen if n not in (*SEQUENTIAL, PARALLEL)]
    repeated = [n for n in SEQUENTIAL if len(seen.get(n, [])) > 1]
    if missing or unknown or repeated:
        raise SystemExit(
            f"stage lines: missing {missing}, unknown {unknown}, repeated {repeated} "
            f"(found {sorted(seen)}); their work would be miscounted as overhead"
        )
    shards = seen[PARALLEL]
    work = {name: seen[name][0] for name in SEQUENTIAL}
    work[PARALLEL] = max(max(shards), sum(shards) / max(1, min(parallelism, len(shards))))
    return {name: work[name] for name in seen}, shards  # in the order the run printed them


def main(overrides: list[str]) -> None:
    from omegaconf import OmegaConf

    from components.config import compose

    args = [f"data.paths=[{CORPUS}]", *overrides]
    parallelism = OmegaConf.to_object(compose(args)).data.parallelism
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        proc = subprocess.run(
            # -v: every task's own lines (its `compute` event among them) on stdout
            [str(Path(sys.executable).parent / "liftoff"), "run", "-v", *args],
            cwd=tmp,
            capture_output=True,
            text=True,
        )
        total = time.perf_counter() - t0
    if proc.returncode:
        print(proc.stdout[-3000:], proc.stderr[-3000:])
        raise SystemExit("liftoff run failed")
    work, shards = stage_work(proc.stdout, parallelism)
    compute = sum(work.values())
    print("stage compute: " + ", ".join(f"{k} {v:.1f}s" for k, v in work.items()))
    print(f"{len(shards)} tokenize-shard task(s), parallelism {parallelism}: " + ", ".join(f"{s:.1f}s" for s in shards))
    print(
        f"total {total:.1f}s, stages {compute:.1f}s, overhead {total - compute:.1f}s ({(total - compute) / total:.0%})"
    )
    report("pipeline_overhead", total - compute, total, "s", stages=work, shard_compute_s=shards)


if __name__ == "__main__":
    main(sys.argv[1:])
