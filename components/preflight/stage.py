"""The preflight stage: benchmark every node through the training launcher, judge, plan, gate."""

from __future__ import annotations

import hashlib
import html
import json
import logging
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
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
from components.preflight.plan import Plan, fits, plan, reserved_gb, verdict
from components.preflight.plan_config import published_peak, tp_group_busbw
from components.preflight.plan_format import format_plan
from components.preflight.spec import PreflightSpec
from components.preflight.verdict import NodeVerdict, floors_for, judge, max_age_min, outliers_for
from components.store import ArtifactStore, Ref, StoreError
from components.summaries import GIB_PER_GB, NodeRow, PreflightSummary, gib

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
    reused_min: float | None = None  # the measurements' age where reused (preflight.max_age_min), else None
    report_version: str | None = None  # this judgement's version (the measurements' own where measured now)

    @property
    def healthy(self) -> list[str]:
        return [v.host + f"#{v.rank}" for v in self.verdicts if v.healthy]

    @property
    def unhealthy(self) -> dict[str, list[str]]:
        return {v.host + f"#{v.rank}": v.reasons for v in self.verdicts if not v.healthy}

    @property
    def warnings(self) -> dict[str, list[str]]:
        """Outliers said and not acted on (preflight.outliers=warn): node -> why."""
        return {v.host + f"#{v.rank}": v.warnings for v in self.verdicts if v.warnings}

    @property
    def left_out(self) -> dict[str, str]:
        """Each node training keeps off, and why (its failed checks, or its quarantine record)."""
        why = {h: "; ".join(r for v in self.verdicts if v.host == h for r in v.reasons) for h in self.excluded_hosts}
        return {h: why[h] or f"quarantined: {self.quarantined.get(h, '')}" for h in self.excluded_hosts}

    @property
    def excluded_hosts(self) -> list[str]:
        """The nodes training must not run on: any of whose devices failed, and the quarantined."""
        return sorted({v.host for v in self.verdicts if not v.healthy} | set(self.quarantined))


def gemm_dtype(nodes: list[NodeMeasurement], precision: Precision) -> str:
    """The GEMM that stands for the training precision: its own, bf16's where a node lacks it."""
    name = recipe(precision).name
    return name if all(name in n.gemm_tflops for n in nodes) else "bf16"


def plan_inputs(nodes: list[dict], precision: Precision) -> tuple[float, float, float | None, float | None]:
    """Achieved TFLOP/s of the precision's GEMM (the linear layers') and of its compute dtype's
    (attention's: bf16 under fp8) on the slowest node, the largest message's bus bandwidth and
    the host's step at a negligible size (slowest node; None where not measured)."""
    measured = [NodeMeasurement.of(n) for n in nodes]
    dtype = gemm_dtype(measured, precision)
    attention = "fp32" if recipe(precision).compute_dtype == "float32" else "bf16"
    attention = attention if all(attention in n.gemm_tflops for n in measured) else dtype
    busbw = [n.largest_busbw_gbps for n in measured]
    host = [n.host_step_s for n in measured]
    return (
        min(n.gemm_tflops[dtype] for n in measured),
        min(n.gemm_tflops[attention] for n in measured),
        min(busbw) if None not in busbw else None,
        max(host) if None not in host else None,
    )


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
            list(v.warnings),
        )
        for n, v in zip(measured, result.verdicts, strict=True)
    ]
    budget = result.device_memory_gb * (1 - cfg.memory_headroom)  # what tensors may hold
    report = str(result.report_path) if result.report_path else None
    return PreflightSummary(rows, dtype, result.plan.total_gb, budget, report, result.reused_min)


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
    if result.reused_min is not None:
        lines += [f"Measurements {result.ref}, reused ({result.reused_min:.0f} min old).", ""]
    lines += [f"- {p}" for p in problems] + ([""] if problems else [])
    # sizes the nodes record in GB (1e9 bytes) are shown in GiB, as every figure the run prints
    heads = [f"{m[:-3]}_gib" if m.endswith("_gb") else m for m in metrics]
    lines += ["| node | verdict | " + " | ".join(heads) + " |", "|---|---|" + "---|" * len(metrics)]
    for node, v in zip(result.nodes, result.verdicts, strict=True):
        cells = " | ".join(
            f"{node.get(m, float('nan')) * (GIB_PER_GB if m.endswith('_gb') else 1):.4g}" for m in metrics
        )
        lines.append(f"| {node['host']}#{node['rank']} | {'healthy' if v.healthy else 'UNHEALTHY'} | {cells} |")
    lines += ["", "## Unhealthy nodes", ""]
    lines += [f"- **{n}**: " + "; ".join(r) for n, r in result.unhealthy.items()] or ["none"]
    if result.warnings:
        lines += ["", "## Warnings (not acted on: preflight.outliers=warn)", ""]
        lines += [f"- **{n}**: " + "; ".join(w) for n, w in result.warnings.items()]
    lines += ["", "## Plan", "", "```", format_plan(result.plan, result.device_memory_gb, cfg.memory_headroom), "```"]
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
        meta.update(warnings=result.warnings, reused_min=result.reused_min)
        name, version = result.ref.name, result.report_version or result.ref.version
        manifest = store.publish("preflight-report", name, version, out, metadata=meta, parents=[str(result.ref)])
    path = store.fetch(manifest) / "report.html"
    log.info("preflight report: %s", path)
    return path


MEASURING = ("gemm_size", "gemm_iters", "membw_mb", "membw_mb_gpu", "allreduce_sizes_mb", "allreduce_sizes_mb_gpu",
             "read_probe_mb", "numerics_s")  # the preflight keys that change what a node measures  # fmt: skip


def fleet_name(
    dataset: str | None, model: ModelConfig | None, train: TrainConfig, cluster: ClusterConfig, cfg: PreflightConfig,
    held_out,
) -> str:  # fmt: skip
    """The name the fleet's measurements are stored under: the node set (scheduler, nodes, processes,
    the nodes held out), the device kind and image, what is measured and how, and the code that
    measures. Two runs with one name may share measurements (preflight.max_age_min)."""
    from components.config import as_plain_dict
    from components.store.keys import code_version

    key = {
        "cluster": [cluster.scheduler.value, cluster.nodes, cluster.procs_per_node, cluster.spare_nodes],
        "held_out": sorted(held_out),
        "device": [cluster.gpu_type, cluster.gpu, cluster.image, cluster.node_selector],
        # what the fabric measures: NCCL's environment, the network, the RDMA devices and the mounts
        "fabric": [
            cluster.env,
            cluster.host_network,
            cluster.extra_resources,
            cluster.capabilities,
            cluster.pod_annotations,
        ],  # fmt: skip
        "measuring": {k: v for k, v in as_plain_dict(cfg).items() if k in MEASURING},
        "dtype": recipe(train.precision).compute_dtype,
        "host_step": host_step_shape(model, train),
        "dataset": dataset,
        "checkpoint_dir": train.checkpoint_dir,
        "code": code_version(),
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:12]
    return f"{cluster.scheduler.value}-{cluster.nodes}n-{digest}"


HOST_STEP_KEYS = ("precision", "fp8_recipe", "activation_checkpointing", "ac_every_n_blocks", "compile",
                  "loss_chunk_tokens", "pp", "micro_batch_size", "grad_accum_steps", "seed", "grad_clip")  # fmt: skip


def host_step_shape(model: ModelConfig | None, train: TrainConfig):
    """What the measured host step (bench.host_step_s) depends on: the proxy model and the
    training settings that change the ops a step dispatches."""
    if model is None:
        return None
    from components.config import as_plain_dict

    proxy = as_plain_dict(bench.proxy_model(model, train))
    return [proxy, {k: v for k, v in as_plain_dict(train).items() if k in HOST_STEP_KEYS}]


def preflight_launch(
    dataset: str | None, model: ModelConfig | None, train: TrainConfig, cluster: ClusterConfig, cfg: PreflightConfig,
    store_cfg: StoreConfig, held_out=(),
) -> Launch:  # fmt: skip
    """The TorchX job that benchmarks every node as training will use it: one replica per node,
    one process per device, a fresh run id."""
    run_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}"
    spec = PreflightSpec(
        preflight=cfg,
        store=replica_store(store_cfg, cluster),
        dataset=dataset,
        name=fleet_name(dataset, model, train, cluster, cfg, held_out),
        run_id=run_id,
        checkpoint_dir=train.checkpoint_dir or ".",  # the disk checkpoints land on, in the replica
        dtype=recipe(train.precision).compute_dtype,
        model=model,
        train=train,
    )
    log_dir = Path(train.run_dir).resolve() / "preflight" / run_id
    name = f"preflight-{run_id[-8:]}"
    launch = Launch("components.preflight.worker", spec, cluster, name, log_dir, log_dir / "nodes")
    launch.exclude_nodes = tuple(sorted(held_out))
    return launch


def reusable_measurements(store: ArtifactStore, name: str, max_age_min: float, processes: int):
    """(the newest `preflight/<name>` version and its nodes, its age in minutes) while younger
    than `max_age_min` and whole (one record per process, each a node's); else None."""
    if max_age_min <= 0:
        return None
    versions = sorted(store.versions("preflight", name), key=lambda m: m.created)
    if not versions:
        return None
    newest = versions[-1]
    age = (datetime.now(timezone.utc) - datetime.fromisoformat(newest.created)).total_seconds() / 60
    if not 0 <= age < max_age_min:
        return None
    try:  # nothing read from the store is trusted: fetch verifies the bytes, this the shape
        nodes = json.loads((store.fetch(newest) / "nodes.json").read_text())
        whole = isinstance(nodes, list) and len(nodes) == processes
        whole = whole and all(isinstance(n, dict) and {"rank", "host"} <= set(n) for n in nodes)
    except (StoreError, OSError, ValueError) as e:
        log.warning("preflight: not reusing %s: %s", newest.ref, e)
        return None
    return (newest, nodes, age) if whole else None


def run_preflight(
    dataset: str | None,
    model: ModelConfig,
    train: TrainConfig,
    cluster: ClusterConfig,
    cfg: PreflightConfig,
    store_cfg: StoreConfig,
    store: ArtifactStore,
) -> PreflightResult:
    """Measure the fleet (or reuse its measurements while preflight.max_age_min allows), judge
    every node, plan the step, publish the report."""
    t0 = time.perf_counter()
    local = cluster.scheduler == Scheduler.local_cwd
    held_out = fleet.quarantined(store)  # measured again only once their records expire or are cleared
    launch = preflight_launch(dataset, model, train, cluster, cfg, store_cfg, held_out)
    spec = launch.spec
    found = reusable_measurements(store, spec.name, max_age_min(cfg, local), cluster.nodes * cluster.procs_per_node)
    if found is not None:
        published, nodes, age = found
        log.info("preflight: reusing %s (%.0f min old)", published.ref, age)
    else:
        run_app(launch)
        published = store.manifest(Ref("preflight", spec.name, spec.run_id))
        nodes = json.loads((store.fetch(published) / "nodes.json").read_text())
    floors, floors_from = floors_for(cfg, cluster.gpu_type, cluster.nodes)
    # the driver runs the battery too where it is the nodes' kind of device: their bitwise reference
    reference = numerics.reference(nodes, bench.accelerator(torch.device("cpu"))) if cfg.numerics_s > 0 else None
    verdicts = judge(nodes, cfg, floors, floors_from, reference, outliers_for(cfg, local))
    healthy_nodes = [n for n, v in zip(nodes, verdicts, strict=True) if v.healthy] or nodes
    tflops, attention_tflops, busbw, host_s = plan_inputs(healthy_nodes, train.precision)
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
        attention_tflops=attention_tflops,
        peak_tflops=published_peak(train, cluster)[0],
        busbw_gbps=busbw if world > 1 else None,
        tp_busbw_gbps=tp_group_busbw(train, cluster),  # the table's NVLink: preflight measures the world's
        host_s=host_s,
        cuda=not all(str(n.get("accelerator", "")).startswith("cpu:") for n in healthy_nodes),
    )
    result = PreflightResult(nodes, verdicts, step_plan, device_gb, time.perf_counter() - t0, published.ref)
    result.quarantined = {n: r.reason for n, r in held_out.items()}
    result.reused_min, result.report_version = (found[2] if found else None), spec.run_id
    record_unhealthy(store, verdicts, cluster.quarantine_ttl_h)  # as judged now, reused numbers or not
    if found is not None:
        result.problems = gate_problems(result, cfg)
        if result.problems:  # say so: new numbers may pass (a store blip, a busy machine)
            age = f"{found[2]:.0f} min old"
            result.problems.append(
                f"measurements {published.ref} reused ({age}); preflight.max_age_min=0 measures again"
            )
        result.report_path = publish_report(result, cfg, store)
        return result
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
    if not fits(result.plan, result.device_memory_gb, cfg.memory_headroom):
        problems.append(
            f"the plan {verdict(result.plan, result.device_memory_gb, cfg.memory_headroom)}: "
            f"{gib(reserved_gb(result.plan, cfg.memory_headroom)):.2f} GiB per device (preflight.memory_headroom="
            f"{cfg.memory_headroom}) > {gib(result.device_memory_gb):.2f} GiB"
        )
    return problems
