"""Run every benchmark (or those named on the command line) and print a summary table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCHMARKS = [
    "tokenize",
    "reader",
    "stream_reader",
    "mixture_reader",
    "train_overhead",
    "hf_trainer",
    "run_checks",
    "checkpoint_async",
    "planner_accuracy",
    "planner_vs_published",
    "preflight_overhead",
    "pipeline_overhead",
]


def main(argv: list[str]) -> int:
    names = argv or BENCHMARKS
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        print(f"unknown benchmark(s) {unknown}; choose from {BENCHMARKS}", file=sys.stderr)
        return 2
    rows, failed = [], False
    for name in names:
        print(f"== {name}", flush=True)
        proc = subprocess.run(
            [sys.executable, "-m", f"benchmarks.{name}"],
            cwd=Path(__file__).parent.parent,
            stdout=subprocess.PIPE,
            text=True,
        )
        print(proc.stdout, end="")
        lines = proc.stdout.strip().splitlines()
        if proc.returncode or not lines:
            failed = True
            rows.append({"name": name, "value": "FAILED"})
            continue
        rows.append(json.loads(lines[-1]))
    print("\n| benchmark | value | baseline | ratio | unit |\n|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['name']} | {_fmt(r.get('value'))} | {_fmt(r.get('baseline'))} | {_fmt(r.get('ratio'))} "
            f"| {r.get('unit', '')} |"
        )
    return 1 if failed else 0


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
