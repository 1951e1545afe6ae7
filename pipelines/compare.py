"""`liftoff compare REF REF...`: runs side by side. Each REF is a model, eval or run version in
the store (a unique version prefix or `latest` will do; KIND defaults to model), or a run folder
of `liftoff run` (its evaluation); for each the model's manifest (its training config, precision, world, dataset), its
architecture (config.json) and its training records (training_metrics.jsonl) are read, each
file verified, with the newest evaluation of that model. Printed: the config keys that differ
and the metrics with their deltas against the first REF; written: one HTML report with the
same tables and the curves of every run overlaid."""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from components import page
from components.identity import NOT_IDENTITY
from components.plots import lines_png, read_timeline
from components.store import ArtifactStore, Manifest, NotFound, Ref
from components.train.report import final_metrics
from pipelines.artifacts import parse_target, run_folder_refs

COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]
METRICS = ("val_loss", "val_perplexity", "val_bits_per_byte", "perplexity_vs_unigram", "final_loss",
           "final_val_loss", "tokens_per_s", "mfu", "peak_memory_gb", "skipped_steps", "loss_spikes")  # fmt: skip
CURVES = (("loss", "loss"), ("lr", "learning rate"), ("grad_norm", "grad norm"), ("tokens_per_s", "tokens/s"))
# train keys outside the training identity that still change what a run measures: its guards
# (skips, rollbacks), its layout and compilation (throughput, memory), what MFU is against
CHANGES_RESULTS = {
    "resume", "val_interval", "on_nonfinite", "max_bad_steps", "on_spike", "loss_spike_factor", "max_spikes",
    "peak_tflops", "compile", "fsdp_sync_every_microbatch", "dp_replicate", "tp", "pp", "pp_schedule",
    "activation_checkpointing", "ac_every_n_blocks",
}  # fmt: skip
# where a run keeps its files, how often it logs, checkpoints and checks itself: not compared
RUNTIME_ONLY = NOT_IDENTITY - CHANGES_RESULTS


class CompareError(ValueError):
    """A REF that names nothing comparable: one line."""


@dataclass
class Side:
    label: str  # A, B, ...
    model: Manifest
    evaluation: Manifest | None
    config: dict[str, object]  # flattened: train.*, model.*, dataset, precision, world
    metrics: dict[str, float]
    steps: list[dict]
    vals: list[dict]


def _model_of(store: ArtifactStore, ref: Ref) -> tuple[Manifest, Manifest | None]:
    """(the model, the evaluation REF names or the model's newest one)."""
    manifest = store.manifest(ref)
    if ref.kind == "eval":
        model = next((p for p in manifest.parents if p.startswith("model/")), None)
        if model is None:
            raise CompareError(f"{ref}: its lineage names no model")
        return store.manifest(Ref.parse(model)), manifest
    if ref.kind == "run":
        with tempfile.TemporaryDirectory() as tmp:
            result = json.loads(store.fetch_file(manifest, "result.json", Path(tmp) / "result.json").read_text())
        return _model_of(store, Ref.parse(result["model"]))
    if ref.kind != "model":
        raise CompareError(f"{ref}: compare takes model/, eval/ or run/ versions, not {ref.kind}/")
    evals = [m for m in store.ls("eval") if str(manifest.ref) in m.parents]
    return manifest, max(evals, key=lambda m: m.created, default=None)


def _flat(prefix: str, value, out: dict) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flat(f"{prefix}.{k}" if prefix else k, v, out)
    else:
        out[prefix] = value


def compare_ref(store: ArtifactStore, text: str) -> Ref:
    """The version a REF names: a run folder's evaluation (its model when it has none), or
    [KIND/]NAME[@VERSION] with KIND model when left out and VERSION a unique prefix or `latest`."""
    if (refs := run_folder_refs(text)) is not None:
        return Ref.parse(refs.get("eval") or refs["model"])
    if "/" not in text.split("@", 1)[0]:
        text = f"model/{text}"
    kind, name, version = parse_target(store, "compare", text, usage="usage: liftoff compare REF REF...")
    return store.resolve(kind, name).ref if version == "latest" else Ref(kind, name, version)


def load(store: ArtifactStore, text: str, label: str) -> Side:
    try:
        model, evaluation = _model_of(store, compare_ref(store, text))
    except NotFound as e:
        raise CompareError(f"{text}: {e}") from None
    config: dict[str, object] = {}
    meta = model.metadata
    train = {k: v for k, v in meta.get("train", {}).items() if k not in RUNTIME_ONLY}
    _flat("train", train, config)
    for key in ("precision", "world", "steps"):  # the run's own record; train.* has steps and precision already
        if f"train.{key}" not in config:
            config[key] = meta.get(key)
    config["dataset"] = next((p for p in model.parents if p.startswith("dataset/")), None)
    config["started"] = meta.get("continued", "fresh")
    for source, drawn in meta.get("mixture", {}).items():  # a mixture's weights: what changed between runs
        config[f"mixture.{source}"] = drawn["weight"]
    with tempfile.TemporaryDirectory() as tmp:
        if "config.json" in model.files:
            arch = json.loads(store.fetch_file(model, "config.json", Path(tmp) / "config.json").read_text())
            for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                        "intermediate_size", "vocab_size"):  # fmt: skip
                config[f"model.{key}"] = arch.get(key)
        steps, vals, metrics = [], [], {}
        if "training_metrics.jsonl" in model.files:
            records = store.fetch_file(model, "training_metrics.jsonl", Path(tmp) / "training_metrics.jsonl")
            steps, vals = read_timeline(records)
            metrics.update(final_metrics(records))
    if evaluation is not None:
        metrics.update(evaluation.metadata.get("metrics", {}))
    return Side(label, model, evaluation, config, metrics, steps, vals)


def config_diff(sides: list[Side]) -> tuple[list[str], int]:
    """(the keys whose values differ between the runs, how many keys there are)."""
    keys = sorted({k for s in sides for k in s.config})
    return [k for k in keys if len({json.dumps(s.config.get(k), sort_keys=True) for s in sides}) > 1], len(keys)


def metric_rows(sides: list[Side]) -> list[list]:
    """[name, A, B, ..., B-A, ...] for the metrics any run has, deltas against the first."""
    rows = []
    per_source = sorted({k for s in sides for k in s.metrics if k.split("/")[0] in METRICS and "/" in k})
    for name in [*(m for m in METRICS if any(m in s.metrics for s in sides)), *per_source]:
        values = [s.metrics.get(name) for s in sides]
        base = values[0]
        deltas = [(v - base) if v is not None and base is not None else None for v in values[1:]]
        rows.append([name, *values, *deltas])
    return rows


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def text_lines(sides: list[Side], report: Path) -> list[str]:
    differ, total = config_diff(sides)
    labels = [s.label for s in sides]
    lines = [f"{s.label}: {s.model.ref}" + (f"  (eval {s.evaluation.ref})" if s.evaluation else "") for s in sides]
    lines.append(f"config: {len(differ)} of {total} keys differ")
    width = max([len(k) for k in differ] + [24])
    for k in differ:
        lines.append(f"  {k:<{width}}  " + "  ".join(f"{_fmt(s.config.get(k)):>14}" for s in sides))
    heads = labels + [f"{x}-A" for x in labels[1:]]
    lines.append("metrics:" + " " * (width - 4) + "  ".join(f"{x:>14}" for x in heads))
    for row in metric_rows(sides):
        cells = [_fmt(v) for v in row[1 : 1 + len(sides)]]
        cells += [f"{d:+.4g}" if d is not None else "-" for d in row[1 + len(sides) :]]
        lines.append(f"  {row[0]:<{width}}  " + "  ".join(f"{c:>14}" for c in cells))
    lines.append(f"report: {report}")
    return lines


def _overlay(sides: list[Side], key: str, ylabel: str) -> str:
    series, styles = [], []
    for i, s in enumerate(sides):
        colour = COLOURS[i % len(COLOURS)]
        points = [x for x in s.steps if x.get(key) is not None]
        series.append((f"{s.label} train" if key == "loss" else s.label, [x["step"] for x in points],
                       [x[key] for x in points]))  # fmt: skip
        styles.append({"color": colour})
        if key == "loss" and s.vals:
            series.append((f"{s.label} val", [v["step"] for v in s.vals], [v["val_loss"] for v in s.vals]))
            styles.append({"color": colour, "linestyle": "--"})
    return lines_png(series, ylabel, figsize=(6, 3.4), styles=styles)


def report_html(sides: list[Side]) -> str:
    differ, total = config_diff(sides)
    labels = [s.label for s in sides]
    header = {f"run {s.label}": str(s.model.ref) for s in sides}
    header["compared"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    config_rows = [[k, *(_fmt(s.config.get(k)) for s in sides)] for k in differ]
    metric_table = [
        [r[0], *(_fmt(v) for v in r[1 : 1 + len(sides)]), *(f"{d:+.4g}" if d is not None else "-"
                                                             for d in r[1 + len(sides) :])]
        for r in metric_rows(sides)
    ]  # fmt: skip
    plots = [(_overlay(sides, key, label), label) for key, label in CURVES if any(s.steps for s in sides)]
    body = [
        page.header(f"Runs side by side: {' vs '.join(labels)}", header),
        page.section(
            "config",
            f"Config: {len(differ)} of {total} keys differ",
            page.table(["key", *labels], config_rows, numeric_from=99),
        ),  # fmt: skip
        page.section(
            "metrics",
            "Metrics (deltas against A)",
            page.table(["metric", *labels, *(f"{x} - A" for x in labels[1:])], metric_table),
        ),  # fmt: skip
        page.section("curves", "Curves, overlaid (val loss dashed)", page.figures(plots)),
    ]
    data = json.dumps({s.label: {"ref": str(s.model.ref), "metrics": s.metrics} for s in sides})
    return page.page(f"liftoff compare: {' vs '.join(str(s.model.ref) for s in sides)}", body, data)


def compare(store: ArtifactStore, refs: list[str], out: Path) -> list[str]:
    """Load every REF, write the report at `out`; the lines to print."""
    if len(refs) < 2:
        raise CompareError(f"compare needs at least two refs, got {len(refs)}")
    if len(refs) > len(COLOURS):
        raise CompareError(f"compare takes at most {len(COLOURS)} refs, got {len(refs)}")
    sides = [load(store, r, chr(ord("A") + i)) for i, r in enumerate(refs)]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report_html(sides))
    return text_lines(sides, out)
