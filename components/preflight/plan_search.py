"""`liftoff plan --search`: every layout liftoff trains today for a config's model, cluster and
global batch, planned, the ones that fit ranked by predicted step time.

A layout here: tensor parallel degree (`train.tp`: 1 or a power of two dividing a node's
processes and the model's heads, kv heads and FFN width, so a tp group is on NVLink), DDP
(with tp only when tp is the world), FSDP or HSDP over the data-parallel ranks
(`train.dp_replicate` dividing the nodes, so a shard group is whole nodes), FSDP's
reduce-scatter after every micro-batch or the last only, activation checkpointing off,
selective or full, and the micro batch (a power of two dividing the sequences per data-parallel rank per
step; accumulation makes up the rest, so the global batch, and with it the optimisation,
never changes). Pipeline parallel (`train.pp`: a power of two dividing the nodes, so a stage
is whole nodes and only stage-to-stage sends cross the network, and the configured pp; each
of torch's schedules; each tp degree above within a stage; FSDP or HSDP within a stage, DDP only
when the stages are the world) is among them. The nodes and processes stay as configured. Every
layout listed
passes the compose-time rules (`components/config/rules.py`): it is a config that trains.
"""

from __future__ import annotations

from dataclasses import dataclass

from components.config import PIPELINE_SCHEDULES, ActivationCheckpointing, Parallelism
from components.config.rules import train_rules
from components.parallel import data_parallel
from components.preflight.plan import Plan, fits
from components.preflight.plan_config import AC, MICRO_BATCH, PARALLELISM, as_overrides, plan_for, with_changes
from components.preflight.plan_format import global_batch
from components.summaries import gib

SYNC, ACCUM, REPLICATE = "train.fsdp_sync_every_microbatch", "train.grad_accum_steps", "train.dp_replicate"
TP, PP, SCHEDULE = "train.tp", "train.pp", "train.pp_schedule"


@dataclass
class Layout:
    changes: dict  # the overrides that turn the config into this layout (empty: as configured)
    plan: Plan


def _micro_batches(per_device: int) -> list[int]:
    return [b for b in (2**i for i in range(per_device.bit_length())) if per_device % b == 0]


def layouts(cfg) -> list[dict]:
    """Every layout's changes against the config that composes, the configured one included."""
    c, m = cfg.cluster, cfg.model
    world = c.nodes * c.procs_per_node
    batch = global_batch(cfg)
    splits = (m.num_heads, m.num_kv_heads, m.ffn_hidden_size, c.procs_per_node)
    found = []
    tps = [tp for tp in (2**i for i in range(c.procs_per_node.bit_length())) if not any(n % tp for n in splits)]
    for tp in tps:
        dp = data_parallel(world, tp=tp)
        if (batch * tp) % world:
            continue
        for parallelism, replicas in _data_parallel(dp, c.nodes, tp == 1):
            layout = {TP: tp, PP: 1, PARALLELISM: parallelism, REPLICATE: replicas}
            found += _batchings(cfg, layout, batch // dp)
    spanning_nodes = {p for p in (2**i for i in range(1, c.nodes.bit_length())) if c.nodes % p == 0}
    for pp in sorted(spanning_nodes | ({cfg.train.pp} if cfg.train.pp > 1 else set())):  # and as configured
        for tp in tps:  # TP within each stage too
            dp = data_parallel(world, tp=tp, pp=pp)
            if world % (pp * tp) or batch % dp:
                continue
            for schedule in PIPELINE_SCHEDULES:
                for parallelism, replicas in _data_parallel(dp, max(1, c.nodes // pp), False):
                    layout = {TP: tp, PP: pp, SCHEDULE: schedule, PARALLELISM: parallelism, REPLICATE: replicas}
                    found += _batchings(cfg, layout, batch // dp)
    return [changes for changes in found if not _breaks_a_rule(with_changes(cfg, changes))]


def _data_parallel(dp: int, nodes: int, ddp: bool) -> list[tuple[Parallelism, int]]:
    """DDP (where `ddp`, or when there is one data-parallel rank), FSDP, and HSDP with replicas
    dividing `nodes` (so a shard group is whole nodes)."""
    found = [(Parallelism.ddp, 1)] if dp == 1 or ddp else []
    if dp > 1:
        found += [(Parallelism.fsdp, r) for r in range(1, nodes + 1) if nodes % r == 0 and dp > r]
    return found


def _breaks_a_rule(cfg) -> bool:
    return bool(train_rules(cfg.train, cfg.cluster, cfg.model))


def _batchings(cfg, layout: dict, per_replica: int) -> list[dict]:
    """A layout with activation checkpointing off, selective and full, each micro batch and
    FSDP's syncs."""
    found = []
    for ac in ActivationCheckpointing:
        for micro in _micro_batches(per_replica):
            accum = per_replica // micro
            # under pipeline parallelism the schedule syncs once a step, whatever the setting
            fsdp_accumulates = layout[PARALLELISM] == Parallelism.fsdp and accum > 1 and layout[PP] == 1
            syncs = (True, False) if fsdp_accumulates else (cfg.train.fsdp_sync_every_microbatch,)
            for sync in syncs:
                full = {**layout, AC: ac, MICRO_BATCH: micro, ACCUM: accum, SYNC: sync}
                found.append({k: v for k, v in full.items() if _value(cfg, k) != v})
    return found


def _value(cfg, key: str):
    group, name = key.split(".")
    return getattr(getattr(cfg, group), name)


def search(cfg) -> list[Layout]:
    """The layouts that fit the device, fastest first (by planned step time when the device has a
    peak, else by memory per device)."""
    headroom = cfg.preflight.memory_headroom
    fitting = []
    for changes in layouts(cfg):
        p, d = plan_for(with_changes(cfg, changes))
        if fits(p, d.memory_gb, headroom):
            fitting.append(Layout(changes, p))
    return sorted(fitting, key=lambda x: (x.plan.step_time_s or 0.0, x.plan.total_gb))


def format_search(cfg, found: list[Layout], top: int = 12) -> str:
    world = cfg.cluster.nodes * cfg.cluster.procs_per_node
    head = (
        f"layouts for {cfg.model.name} on {cfg.cluster.nodes} node(s) x {cfg.cluster.procs_per_node} "
        f"(world {world}), global batch fixed: {len(found)} fit"
        + (f", the fastest {top} shown" if len(found) > top else "")
    )
    rows = [("#", "GiB/device", "step s", "tokens/s", "MFU", "overrides")]
    for i, layout in enumerate(found[:top], 1):
        p = layout.plan
        timed = p.step_time_s is not None
        rows.append((
            str(i),
            f"{gib(p.total_gb):.1f}",
            f"{p.step_time_s:.3g}" if timed else "-",
            f"{p.tokens_per_s:,.0f}" if timed else "-",
            f"{p.mfu:.1%}" if p.mfu is not None else "-",
            " ".join(as_overrides(layout.changes)) or "(as configured)",
        ))  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = [head, ""]
    for r in rows:
        lines.append("  ".join(f"{c:>{w}}" for c, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1])
    return "\n".join(lines)


def best_overrides(found: list[Layout]) -> list[str]:
    return as_overrides(found[0].changes) if found else []
