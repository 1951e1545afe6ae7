"""planner_vs_published: `liftoff plan` held to published H100 training runs.

Each row of `benchmarks/published_h100.json` is a published run (its source: a repository path
at a commit and its table) expressed as liftoff config overrides: the model's shape, the layout,
precision, sequence, local batch, activation checkpointing and compile, on the publication's GPUs.
The planner plans it from the config alone, as `liftoff plan` does (components/preflight/), and
each row prints planned / published for tokens/s per GPU and for peak memory per GPU, and
whether the plan calls a run that completed "does not fit". Planned memory is the reserved peak
(what tensors hold plus `preflight.memory_headroom`), as torchtitan's published peak is torch's
max reserved. The summary is the share of rows within +-15% for each, and the number of
completed runs refused. Rows a layout liftoff cannot express (context parallelism) are listed,
not planned. FITTED on these rows (components/devices.py, components/preflight/plan.py): the
H100's efficiency per recipe on the three 8b-fsdp8 rows, and the memory headroom (0.1); every
other figure of every row is predicted.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from omegaconf import OmegaConf

from benchmarks.common import report

DATA = Path(__file__).with_name("published_h100.json")
BAND = 0.15


def planned_rows(data: dict) -> list[dict]:
    from components.config import compose
    from components.preflight.plan import fits, reserved_gb
    from components.preflight.plan_config import plan_for

    rows = []
    for row in data["rows"]:
        overrides = [*data["models"][row["model"]], *data["gpu"], *row["overrides"]]
        cfg = OmegaConf.to_object(compose(overrides))
        p, d = plan_for(cfg)
        world = cfg.cluster.nodes * cfg.cluster.procs_per_node
        tps = p.tokens_per_s / world if p.tokens_per_s else float("nan")
        gib = reserved_gb(p, cfg.preflight.memory_headroom) * 1e9 / 2**30  # as torch's max reserved
        rows.append({
            "id": row["id"], "table": row["table"], "source": data["sources"][row["source"]].split(" ")[0],
            "tps_ratio": tps / row["tokens_per_s_per_gpu"],
            "memory_ratio": gib / row["memory_gib"] if "memory_gib" in row else None,  # not every table publishes it
            "planned_tps": tps, "published_tps": row["tokens_per_s_per_gpu"],
            "planned_gib": gib, "published_gib": row.get("memory_gib"),
            "fits": fits(p, d.memory_gb, cfg.preflight.memory_headroom), "caveat": row.get("caveat", ""),
        })  # fmt: skip
    return rows


def within(ratio: float) -> bool:
    return abs(ratio - 1) <= BAND


def main() -> None:
    data = json.loads(DATA.read_text())
    rows = planned_rows(data)
    print(f"{'row':34} {'tokens/s/GPU planned/published':>32} {'GiB planned/published':>24}  verdict")
    for r in rows:
        tps = f"{r['planned_tps']:,.0f} / {r['published_tps']:,} = {r['tps_ratio']:.2f}"
        mem = f"{r['planned_gib']:.1f} / " + (
            f"{r['published_gib']} = {r['memory_ratio']:.2f}" if r["memory_ratio"] is not None else "-"
        )
        verdict = "fits" if r["fits"] else "DOES NOT FIT"
        print(f"{r['id']:34} {tps:>32} {mem:>24}  {verdict}{'  (' + r['caveat'] + ')' if r['caveat'] else ''}")
    for skipped in data["not_expressible"]:
        print(f"not planned: {skipped['table']} of {skipped['source']}: {skipped['why']}")
    tps_share = sum(within(r["tps_ratio"]) for r in rows) / len(rows)
    published = [r for r in rows if r["memory_ratio"] is not None]  # the rows that publish memory
    mem_share = sum(within(r["memory_ratio"]) for r in published) / len(published)
    refused = [r["id"] for r in rows if not r["fits"]]
    print(f"within +-{BAND:.0%}: tokens/s {tps_share:.0%} of {len(rows)} rows, memory {mem_share:.0%} of the "
          f"{len(published)} that publish it; "
          f"completed runs called 'does not fit': {len(refused)} {refused}")  # fmt: skip
    report(
        "planner_vs_published", tps_share, 0.8, "share of rows within +-15% (tokens/s per GPU)",
        memory_share=mem_share, refused=len(refused), rows=len(rows),
        **{f"tps_{r['id']}": round(r["tps_ratio"], 3) for r in rows},
        **{f"mem_{r['id']}": round(r["memory_ratio"], 3) for r in published},
    )  # fmt: skip


if __name__ == "__main__":
    main()
    sys.exit(0)
