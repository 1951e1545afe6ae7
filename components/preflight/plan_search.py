"""`liftoff plan --search`: every layout liftoff trains today for a config's model, cluster and
global batch, planned, the ones that fit ranked by predicted step time.

A layout here: DDP, FSDP or HSDP (`train.dp_replicate` dividing the nodes, so a shard group
is whole nodes), FSDP's reduce-scatter after every micro-batch or the last only,
activation checkpointing off or on, and the micro batch (a power of two dividing the
sequences per device per step; accumulation makes up the rest, so the global batch, and
with it the optimisation, never changes). The nodes and processes stay as configured.
Tensor and pipeline parallel are not among them: the trainer does not run them yet.
"""

from __future__ import annotations

from dataclasses import dataclass

from components.config import Parallelism
from components.preflight.plan import Plan, fits
from components.preflight.plan_config import AC, MICRO_BATCH, PARALLELISM, as_overrides, plan_for, with_changes

SYNC, ACCUM, REPLICATE = "train.fsdp_sync_every_microbatch", "train.grad_accum_steps", "train.dp_replicate"


@dataclass
class Layout:
    changes: dict  # the overrides that turn the config into this layout (empty: as configured)
    plan: Plan


def _micro_batches(per_device: int) -> list[int]:
    return [b for b in (2**i for i in range(per_device.bit_length())) if per_device % b == 0]


def layouts(cfg) -> list[dict]:
    """Every layout's changes against the config, the configured one included."""
    t = cfg.train
    per_device = t.micro_batch_size * t.grad_accum_steps
    data_parallel = [(Parallelism.ddp, 1)] + [
        (Parallelism.fsdp, r) for r in range(1, cfg.cluster.nodes + 1) if cfg.cluster.nodes % r == 0
    ]
    found = []
    for parallelism, replicas in data_parallel:
        for ac in (False, True):
            for micro in _micro_batches(per_device):
                accum = per_device // micro
                fsdp_accumulates = parallelism == Parallelism.fsdp and accum > 1
                syncs = (True, False) if fsdp_accumulates else (t.fsdp_sync_every_microbatch,)
                for sync in syncs:
                    layout = {PARALLELISM: parallelism, REPLICATE: replicas, AC: ac, MICRO_BATCH: micro,
                              ACCUM: accum, SYNC: sync}  # fmt: skip
                    found.append({k: v for k, v in layout.items() if _value(cfg, k) != v})
    return found


def _value(cfg, key: str):
    group, name = key.split(".")
    return getattr(getattr(cfg, group), name)


def search(cfg) -> list[Layout]:
    """The layouts that fit the device, fastest first (by planned step time when the device has a
    peak, else by memory per device)."""
    safety = cfg.preflight.memory_safety
    fitting = []
    for changes in layouts(cfg):
        p, d = plan_for(with_changes(cfg, changes))
        if fits(p, d.memory_gb, safety):
            fitting.append(Layout(changes, p))
    return sorted(fitting, key=lambda x: (x.plan.step_time_s or 0.0, x.plan.total_gb))


def format_search(cfg, found: list[Layout], top: int = 12) -> str:
    world = cfg.cluster.nodes * cfg.cluster.procs_per_node
    head = (
        f"layouts for {cfg.model.name} on {cfg.cluster.nodes} node(s) x {cfg.cluster.procs_per_node} "
        f"(world {world}), global batch fixed: {len(found)} fit"
        + (f", the fastest {top} shown" if len(found) > top else "")
    )
    rows = [("#", "GB/device", "step s", "tokens/s", "MFU", "overrides")]
    for i, layout in enumerate(found[:top], 1):
        p = layout.plan
        timed = p.step_time_s is not None
        rows.append((
            str(i),
            f"{p.total_gb:.1f}",
            f"{p.step_time_s:.3g}" if timed else "-",
            f"{p.tokens_per_s:,.0f}" if timed else "-",
            f"{p.mfu:.1%}" if timed else "-",
            " ".join(as_overrides(layout.changes)) or "(as configured)",
        ))  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = [head, ""]
    for r in rows:
        lines.append("  ".join(f"{c:>{w}}" for c, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1])
    return "\n".join(lines)


def best_overrides(found: list[Layout]) -> list[str]:
    return as_overrides(found[0].changes) if found else []
