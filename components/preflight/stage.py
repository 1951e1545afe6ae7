"""The preflight stage: benchmark every node through the training launcher, judge, plan, gate."""

from __future__ import annotations

import html
import json
import logging
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch

from components import fleet
from components.config import (
    ClusterConfig,
    ModelConfig,
    Precision,
    PreflightConfig,
    Scheduler,
    StoreConfig,
    TrainConfig,
)
from components.launcher import Launch, replica_store, run_app
from components.precision import recipe
from components.preflight import bench, numerics
from components.preflight.bench import NodeMeasurement
from components.preflight.plan import Plan, fits, plan
from components.preflight.plan_config import tp_group_busbw
from components.preflight.plan_format import format_plan
from components.preflight.spec import PreflightSpec
from components.preflight.verdict import NodeVerdict, floors_for, judge
from components.store import ArtifactStore, Ref
from components.summaries import NodeRow, PreflightSummary

log = logging.getLogger(__name__)


class PreflightFailed(RuntimeError):
    """The fleet or the plan is not fit to train; the message is the readable summary."""

    def __init__(self, problems: list[str]):
        super().__init__("preflight failed:\n- " + "\n- ".join(problems))
        self.summary = "preflight failed: " + "; ".join(problems)  # one line (the `failed` event's)


@dataclass
class PreflightResult:
    nodes: list[dict]
    verdicts: list[NodeVerdict]
    plan: Plan
    device_memory_gb: float
    seconds: float
    ref: Ref | None = None  # the nodes' measurements in the store
    report_path: Path | None = None  # the published report.html, fetched: a file a browser opens
    quarantined: dict = field(default_factory=dict)  # node -> its quarantine record: not launched on
    markdown: str | None = None  # the report, as published (the KFP UI shows it)
    problems: list[str] | None = None  # why the gate fails, judged once when the report is made

    @property
    def healthy(self) -> list[str]:
        return [v.host + f"#{v.rank}" for v in self.verdicts if v.healthy]

    @property
    def unhealthy(self) -> dict[str, list[str]]:
        return {v.host + f"#{v.rank}": v.reasons for v in self.verdicts if not v.healthy}

    @property
    def excluded_hosts(self) -> list[str]:
        """The nodes training must not run on: any of whose devices failed, and the quarantined."""
        return sorted({v.host for v in self.verdicts if not v.healthy} | set(self.quarantined))


def gemm_dtype(nodes: list[NodeMeasurement], precision: Precision) -> str:
    """The GEMM that stands for the training precision: its own, bf16's where a node lacks it."""
    name = recipe(precision).name
    return name if all(name in n.gemm_tflops for n in nodes) else "bf16"


def plan_inputs(nodes: list[dict], precision: Precision) -> tuple[float, float | None]:
    """Achieved TFLOP/s of the compute dtype (slowest node) and the largest message's bus bandwidth."""
    measured = [NodeMeasurement.of(n) for n in nodes]
    dtype = gemm_dtype(measured, precision)
    busbw = [n.largest_busbw_gbps for n in measured]
    return min(n.gemm_tflops[dtype] for n in measured), (min(busbw) if None not in busbw else None)


def summary(result: PreflightResult, cfg: PreflightConfig, precision: Precision) -> PreflightSummary:
    """What `liftoff run` shows of the verdict: a row per node, the plan against the budget."""
    measured = [NodeMeasurement.of(n) for n in result.nodes]
    dtype = gemm_dtype(measured, precision)
    rows = [
        NodeRow(
            f"{v.host}#{v.rank}",
            v.healthy,
            n.gemm_tflops.get(dtype),
            n.membw_gbps,
            n.largest_busbw_gbps,
            n.device_memory_gb,
            list(v.reasons),
        )
        for n, v in zip(measured, result.verdicts, strict=True)
    ]
    budget = result.device_memory_gb * cfg.memory_safety
    report = str(result.report_path) if result.report_path else None
    return PreflightSummary(rows, dtype, result.plan.total_gb, budget, report)


def report_markdown(result: PreflightResult, cfg: PreflightConfig, problems: list[str] | None = None) -> str:
    metrics = sorted(
        {
            k
            for n in result.nodes
            for k, v in n.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "rank"
        }
    )
    problems = gate_problems(result, cfg) if problems is None else problems
    lines = ["# Preflight", "", "**passed**" if not problems else "**failed**", ""]
    lines += [f"- {p}" for p in problems] + ([""] if problems else [])
    lines += ["| node | verdict | " + " | ".join(metrics) + " |", "|---|---|" + "---|" * len(metrics)]
    for node, v in zip(result.nodes, result.verdicts, strict=True):
        cells = " | ".join(f"{node.get(m, float('nan')):.4g}" for m in metrics)
        lines.append(f"| {node['host']}#{node['rank']} | {'healthy' if v.healthy else 'UNHEALTHY'} | {cells} |")
    lines += ["", "## Unhealthy nodes", ""]
    lines += [f"- **{n}**: " + "; ".join(r) for n, r in result.unhealthy.items()] or ["none"]
    lines += ["", "## Plan", "", "```", format_plan(result.plan, result.device_memory_gb, cfg.memory_safety), "```"]
    return "\n".join(lines)


REPORT_STYLE = """
body{font:15px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#1d2330;background:#f4f6fa;margin:0}
main{max-width:1180px;margin:0 auto;padding:24px;background:#fff}
table{border-collapse:collapse;display:block;overflow-x:auto;font-size:13px}
th,td{padding:4px 8px;border-bottom:1px solid #e3e7ef;text-align:right;white-space:nowrap}
th{background:#eef2fb}th:nth-child(-n+2),td:nth-child(-n+2){text-align:left}
pre{background:#f4f6fa;padding:12px;border-radius:6px;overflow-x:auto}
"""


def report_html(markdown: str, title: str) -> str:
    """The Markdown report as one self-contained HTML page, for the store (the KFP UI shows the Markdown)."""
    from markdown_it import MarkdownIt

    body = MarkdownIt("commonmark", {"html": False}).enable("table").render(markdown)
    return (
        f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{REPORT_STYLE}</style></head><body><main>{body}</main></body></html>"
    )


def publish_report(result: PreflightResult, cfg: PreflightConfig, store: ArtifactStore) -> Path:
    """`preflight-report/<name>@<run id>` (report.html and report.md, the verdict in its metadata)
    next to the measurements it reads, whether or not the gate passes; its local report.html."""
    if result.problems is None:
        result.problems = gate_problems(result, cfg)
    problems = result.problems
    result.markdown = markdown = report_markdown(result, cfg, problems)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        (out / "report.md").write_text(markdown)
        (out / "report.html").write_text(report_html(markdown, f"liftoff preflight {result.ref}"))
        meta = {"passed": not problems, "problems": problems, "healthy": result.healthy, "unhealthy": result.unhealthy}
        name, version = result.ref.name, result.ref.version
        manifest = store.publish("preflight-report", name, version, out, metadata=meta, parents=[str(result.ref)])
    path = store.fetch(manifest) / "report.html"
    log.info("preflight report: %s", path)
    return path


def preflight_launch(
    dataset: str | None, train: TrainConfig, cluster: ClusterConfig, cfg: PreflightConfig, store_cfg: StoreConfig
) -> Launch:
    """The TorchX job that benchmarks every node as training will use it: one replica per node,
    one process per device, a fresh run id."""
    run_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}"
    spec = PreflightSpec(
        preflight=cfg,
        store=replica_store(store_cfg, cluster),
        dataset=dataset,
        name=f"{cluster.scheduler.value}-{cluster.nodes}n",
        run_id=run_id,
        checkpoint_dir=train.checkpoint_dir or ".",  # the disk checkpoints land on, in the replica
        dtype=recipe(train.precision).compute_dtype,
    )
    log_dir = Path(train.run_dir).resolve() / "preflight" / run_id
    name = f"preflight-{run_id[-8:]}"
    return Launch("components.preflight.worker", spec, cluster, name, log_dir, log_dir / "nodes")


def run_preflight(
    dataset: str | None,
    model: ModelConfig,
    train: TrainConfig,
    cluster: ClusterConfig,
    cfg: PreflightConfig,
    store_cfg: StoreConfig,
    store: ArtifactStore,
) -> PreflightResult:
    t0 = time.perf_counter()
    launch = preflight_launch(dataset, train, cluster, cfg, store_cfg)
    held_out = fleet.quarantined(store)  # measured again only once their records expire or are cleared
    launch.exclude_nodes = tuple(sorted(held_out))
    spec = launch.spec
    run_app(launch)
    published = store.manifest(Ref("preflight", spec.name, spec.run_id))
    nodes = json.loads((store.fetch(published) / "nodes.json").read_text())
    floors, floors_from = floors_for(cfg, cluster.gpu_type, cluster.nodes)
    # the driver runs the battery too where it is the nodes' kind of device: their bitwise reference
    reference = numerics.reference(nodes, bench.accelerator(torch.device("cpu"))) if cfg.numerics_s > 0 else None
    verdicts = judge(nodes, cfg, floors, floors_from, reference)
    healthy_nodes = [n for n, v in zip(nodes, verdicts, strict=True) if v.healthy] or nodes
    tflops, busbw = plan_inputs(healthy_nodes, train.precision)
    device_gb = cfg.device_memory_gb or min(n["device_memory_gb"] for n in nodes)
    stats = store.manifest(Ref.parse(dataset)).metadata.get("stats", {}) if dataset else {}  # no data download
    vocab, seq_len = stats.get("vocab_size"), stats.get("seq_len", model.max_seq_len)
    world = cluster.nodes * cluster.procs_per_node
    step_plan = plan(
        model,
        train,
        world,
        seq_len,
        vocab,
        tflops=tflops,
        peak_tflops=train.peak_tflops,
        busbw_gbps=busbw if world > 1 else None,
        tp_busbw_gbps=tp_group_busbw(train, cluster),  # the table's NVLink: preflight measures the world's
    )
    result = PreflightResult(nodes, verdicts, step_plan, device_gb, time.perf_counter() - t0, published.ref)
    result.quarantined = {n: r.reason for n, r in held_out.items()}
    record_unhealthy(store, verdicts, cluster.quarantine_ttl_h)
    if cfg.quarantine and cluster.scheduler == Scheduler.kubernetes and result.unhealthy:
        from components.preflight.quarantine import quarantine_nodes

        bad = [v for v in verdicts if not v.healthy]
        quarantine_nodes([v.host for v in bad], {v.host: v.reasons for v in bad})
    result.problems = gate_problems(result, cfg)  # once: the report says it, the gate acts on it
    result.report_path = publish_report(result, cfg, store)
    return result


def record_unhealthy(store: ArtifactStore, verdicts: list[NodeVerdict], ttl_h: float) -> None:
    """A quarantine record for each node with an unhealthy device: the next launches keep off it.
    Only when some node is healthy: a finding against every node (floors set too high, the
    wrong cluster.gpu_type, a fabric all on TCP) is the config's or the fabric's, not a node's."""
    if ttl_h <= 0 or all(not v.healthy for v in verdicts):
        return
    for host in sorted({v.host for v in verdicts if not v.healthy}):
        reasons = [r for v in verdicts if v.host == host for r in v.reasons]
        fleet.quarantine(store, host, "preflight", "; ".join(reasons), ttl_h * 3600, {"reasons": reasons})


def gate(result: PreflightResult) -> None:
    """Stop the run before training when the fleet or the plan cannot work (as judged once,
    by `run_preflight`, for its report)."""
    problems = result.problems
    if problems is None:
        raise ValueError("preflight: the gate has not judged this result (run_preflight judges it)")
    if problems:
        raise PreflightFailed(problems)


def gate_problems(result: PreflightResult, cfg: PreflightConfig) -> list[str]:
    """Why the fleet or the plan cannot train (none: the gate passes)."""
    problems = []
    hosts = {v.host for v in result.verdicts}
    healthy = len(hosts - {v.host for v in result.verdicts if not v.healthy})  # one bad device excludes its node
    # null: every node (the gang asks for cluster.nodes; an excluded one could leave it unschedulable)
    need = len(hosts) if cfg.min_healthy_nodes is None else cfg.min_healthy_nodes
    if healthy < need:
        problems.append(
            f"{healthy} healthy node(s), preflight.min_healthy_nodes={cfg.min_healthy_nodes}"
            + (f" (every node: {need})" if cfg.min_healthy_nodes is None else "")
            + ": "
            + "; ".join(f"{n}: {', '.join(r)}" for n, r in result.unhealthy.items())
        )
    if not fits(result.plan, result.device_memory_gb, cfg.memory_safety):
        problems.append(
            f"planned memory {result.plan.total_gb:.2f} GB per device exceeds {result.device_memory_gb:.2f}"
            f" GB x preflight.memory_safety={cfg.memory_safety} = "
            f"{result.device_memory_gb * cfg.memory_safety:.2f} GB"
        )
    return problems
