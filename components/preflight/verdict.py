"""Per-node verdicts: each metric against the fleet (robust z-score) and absolute floors."""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field

from components.config import PERF_METRICS, PreflightConfig
from components.preflight import numerics
from components.preflight.bench import BUSBW, NodeMeasurement
from components.robust import robust_z

MUST_MATCH = ("accelerator", "driver", "torch", "cuda")


@dataclass
class NodeVerdict:
    rank: int
    host: str
    healthy: bool = True
    reasons: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # outliers said, not acted on (preflight.outliers=warn)

    def fail(self, reason: str) -> None:
        self.healthy = False
        self.reasons.append(reason)


def perf_metrics(node: dict) -> dict[str, float]:
    numbers = (int, float)
    return {k: float(v) for k, v in node.items() if k.startswith(PERF_METRICS) and isinstance(v, numbers)}


def floors_for(cfg: PreflightConfig, gpu_type: str | None, nodes: int) -> tuple[dict[str, float], str]:
    """(metric -> absolute minimum, where they come from): the floors of `cluster.gpu_type`
    from the device table (`preflight.device_floors`), with `preflight.floors` over them."""
    from components.devices import FLOOR_FRACTION, device, preflight_floors

    d = device(gpu_type) if gpu_type and cfg.device_floors else None
    own = dict(cfg.floors)
    if d is None:
        return own, "preflight.floors"
    where = f"{FLOOR_FRACTION:.0%} of cluster.gpu_type={gpu_type}'s figures (devices.py)"
    return {**preflight_floors(d, nodes), **own}, where + (", preflight.floors over them" if own else "")


def outliers_for(cfg: PreflightConfig, local: bool) -> str:
    """What a performance outlier does: `preflight.outliers`, else warn on the local scheduler
    (its "nodes" share one busy machine: a slow one is the laptop, not a node) and quarantine on a cluster."""
    return cfg.outliers or ("warn" if local else "quarantine")


def max_age_min(cfg: PreflightConfig, local: bool) -> float:
    """How young the fleet's stored measurements must be to be reused: `preflight.max_age_min`,
    else an hour locally and never on a cluster (nodes change under a scheduler between runs)."""
    return cfg.max_age_min if cfg.max_age_min is not None else (60.0 if local else 0.0)


def metric_value(node: dict, metric: str) -> float | None:
    if metric in node and isinstance(node[metric], int | float):
        return float(node[metric])
    if metric == BUSBW:  # a floor on it holds the largest message measured
        return NodeMeasurement.of(node).largest_busbw_gbps
    return None


def judge(
    nodes: list[dict],
    cfg: PreflightConfig,
    floors: dict[str, float] | None = None,
    floors_from: str = "preflight.floors",
    reference: dict | None = None,
    outliers: str = "quarantine",
) -> list[NodeVerdict]:
    """`floors`: the absolute minimums (`floors_for`); None: `preflight.floors` as given;
    `reference`: the driver's own numerics battery (numerics.reference), where it has one;
    `outliers`: what a node far below the others does (`outliers_for`): fail it, or warn only."""
    floors = dict(cfg.floors) if floors is None else floors
    verdicts = [NodeVerdict(n["rank"], n["host"]) for n in nodes]
    for i, reasons in numerics.problems(nodes, reference).items():
        for reason in reasons:
            verdicts[i].fail(reason)
    for i, (node, verdict) in enumerate(zip(nodes, verdicts, strict=True)):
        for metric, value in perf_metrics(node).items():
            peers = [float(other[metric]) for j, other in enumerate(nodes) if j != i and metric in other]
            z = robust_z(value, peers)
            if peers and z < -cfg.zscore_threshold:
                why = (
                    f"{metric}={value:.4g} is {-z:.1f} robust SDs below the other nodes' median "
                    f"{statistics.median(peers):.4g} (preflight.zscore_threshold={cfg.zscore_threshold})"
                )
                verdict.fail(why) if outliers == "quarantine" else verdict.warnings.append(why)
        for metric, floor in floors.items():
            value = metric_value(node, metric)
            if value is not None and value < floor:
                verdict.fail(f"{metric}={value:.4g} is below the floor {floor:g} ({floors_from})")
        if node.get("storage_probe_ok") is False:
            verdict.fail("storage write/read/delete probe returned different bytes")
    for key in MUST_MATCH:
        values = Counter(n.get(key) for n in nodes)
        if len(values) > 1:
            common, count = values.most_common(1)[0]
            tie = count * 2 <= len(nodes)
            for node, verdict in zip(nodes, verdicts, strict=True):
                if tie or node.get(key) != common:
                    verdict.fail(f"{key}={node.get(key)} differs from the fleet ({dict(values)})")
    return verdicts
