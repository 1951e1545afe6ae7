"""What each stage hands back about its run, typed: one dataclass per stage, serialised into its
output artifact's metadata under `SUMMARY` (KFP keeps artifact metadata with the run, the UI
shows it) and worded by its own `line()`. `liftoff run` renders the summaries it finds in a
task's outputs (pipelines/summary.py) and knows no stage's metadata keys: a stage changes
what it records without the CLI noticing, and a new field is a field here."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from components import events

SUMMARY = "liftoff_summary"


def _nan(x) -> float:
    return float("nan") if x is None else float(x)


GIB_PER_GB = 1e9 / 2**30  # what the run prints is in GiB; the stages record GB (1e9 bytes, data sheets' unit)


def gib(gb: float | None) -> float | None:
    return None if gb is None else gb * GIB_PER_GB


@dataclass
class TokenizeSummary:
    ref: str
    train_blocks: int
    val_blocks: int
    reused: bool

    def line(self) -> str:
        reused = ", found in the store" if self.reused else ""
        return f"{self.ref}: {self.train_blocks:,.0f} train / {self.val_blocks:,.0f} val blocks{reused}"


@dataclass
class NodeRow:
    """One preflight node as the verdict table shows it."""

    node: str
    healthy: bool
    gemm_tflops: float | None  # in the training precision (bf16's where it has no GEMM of its own)
    membw_gbps: float | None
    busbw_gbps: float | None  # the largest all-reduce message measured
    memory_gb: float | None
    reasons: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # outliers said, not acted on (preflight.outliers=warn)


@dataclass
class PreflightSummary:
    nodes: list[NodeRow]
    gemm_dtype: str
    plan_total_gb: float
    budget_gb: float
    report_html: str | None = None  # the published report, fetched (a file a browser opens)
    reused_min: float | None = None  # the stored measurements' age, where reused (preflight.max_age_min)
    skipped: str | None = None  # why nothing was measured (a resumed run with no step left)

    def line(self) -> str:
        if self.skipped:
            return f"skipped: {self.skipped}"
        healthy = sum(n.healthy for n in self.nodes)
        plan = f"plan {gib(self.plan_total_gb):.3g} GiB per device of a {gib(self.budget_gb):.3g} GiB budget"
        reused = f"measurements reused ({self.reused_min:.0f} min old), " if self.reused_min is not None else ""
        warned = sum(bool(n.warnings) for n in self.nodes)
        warned = f", {warned} warned (preflight.outliers=warn)" if warned else ""
        return f"{reused}{healthy}/{len(self.nodes)} nodes healthy{warned}, {plan}"

    def table(self) -> list[str]:
        """One row per node: its health and the benchmarks it was judged by, then why each
        unhealthy node is."""
        head = ["node", "verdict", f"{self.gemm_dtype} TFLOP/s", "mem GB/s", "busbw GB/s", "memory GiB"]
        rows = [head]
        for n in self.nodes:
            figures = (n.gemm_tflops, n.membw_gbps, n.busbw_gbps, gib(n.memory_gb))
            cells = [("-" if v is None else f"{v:.4g}") for v in figures]
            rows.append([n.node, "healthy" if n.healthy else "UNHEALTHY", *cells])
        widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
        table = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
        table += [f"{n.node}: {'; '.join(n.reasons)}" for n in self.nodes if not n.healthy]
        return table + [f"{n.node}: warning: {'; '.join(n.warnings)}" for n in self.nodes if n.warnings]


@dataclass
class TrainSummary:
    model: str
    continued: str  # "fresh", or the checkpoint it went on from
    initial_loss: float | None
    final_loss: float | None
    tokens_per_s: float
    peak_memory_gb: float
    nodes: list[str] = field(default_factory=list)  # the nodes the last attempt trained on, by rank
    left_out: dict[str, str] = field(default_factory=dict)  # node -> why training kept off it

    def line(self) -> str:
        losses = f"loss {_nan(self.initial_loss):.2f} -> {_nan(self.final_loss):.2f}"
        speed = f"{self.tokens_per_s:,.0f} tokens/s, peak {gib(self.peak_memory_gb):.2f} GiB"
        where = f"; on {', '.join(self.nodes)}" if self.nodes else ""
        out = "".join(f"; left out {n}: {why}" for n, why in self.left_out.items())
        return f"{self.continued}; {losses}, {speed}, {self.model}{where}{out}"


@dataclass
class ValidateSummary:
    checks: dict[str, bool]

    def line(self) -> str:
        return f"{sum(self.checks.values())}/{len(self.checks)} checks passed"


@dataclass
class EvaluateSummary:
    val_loss: float
    val_perplexity: float

    def line(self) -> str:
        return f"val loss {self.val_loss:.4f}, perplexity {self.val_perplexity:.2f}"


STAGES = (TokenizeSummary, PreflightSummary, TrainSummary, ValidateSummary, EvaluateSummary)
KINDS = {cls.__name__: cls for cls in STAGES}


def attach(artifact, summary) -> None:
    """Put `summary` into a KFP output artifact's metadata (JSON without NaN: KFP keeps metadata
    as a protobuf Struct; a NaN travels as None)."""
    artifact.metadata[SUMMARY] = {"kind": type(summary).__name__, **events.strict(dataclasses.asdict(summary))}


def read(metadata: dict):
    """The summary a stage's artifact metadata carries, typed; None when it has none."""
    record = dict((metadata or {}).get(SUMMARY) or {})
    cls = KINDS.get(record.pop("kind", None))
    if cls is None:
        return None
    try:
        if cls is PreflightSummary:
            record["nodes"] = [NodeRow(**n) for n in record["nodes"]]
        return cls(**record)
    except (TypeError, KeyError):  # another version's summary (a cached task): none to show
        return None


def find(outputs: dict):
    """The summary among a task's outputs (whichever artifact carries it)."""
    for artifact in outputs.values():
        if (summary := read(getattr(artifact, "metadata", None))) is not None:
            return summary
    return None
