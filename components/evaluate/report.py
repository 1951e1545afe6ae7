"""The evaluate report: one self-contained HTML page (inline CSS, plots as data URIs) headed
by what was evaluated (model, training run, dataset, config, code version, dates), then the
training curves the model carries, the metrics with their baseline deltas, and samples."""

from __future__ import annotations

import html
import json
from pathlib import Path

from components.page import STYLE, header
from components.plots import curve_png, expert_load_png, loss_png, read_timeline
from components.store import Manifest

LOWER_IS_BETTER = {"val_loss", "val_perplexity", "val_bits_per_byte", "perplexity_vs_unigram"}
HIGHER_IS_BETTER = {"inference_tokens_per_s"}


def identity_rows(
    model: Manifest, dataset: str, model_dir: Path | None, evaluated: str, eval_ref: str | None = None
) -> dict[str, str]:
    """What the report is about, read from the model's manifest and its Hugging Face config."""
    meta, train = model.metadata, model.metadata.get("train", {})
    arch = {}
    if model_dir is not None and (model_dir / "config.json").is_file():
        arch = json.loads((model_dir / "config.json").read_text())
    preset = model.ref.name
    if arch:
        preset += (
            f" ({arch.get('num_hidden_layers')} layers, hidden {arch.get('hidden_size')}, "
            f"{arch.get('num_attention_heads')} heads, vocab {arch.get('vocab_size')})"
        )
    rows = {
        "model": str(model.ref),
        "training run": str(meta.get("identity", "unknown")),
        "dataset": dataset,
        "model preset": preset,
        "precision": str(meta.get("precision", train.get("precision", "unknown"))),
        "steps": str(meta.get("steps", train.get("steps", "unknown"))),
        "started": str(meta.get("continued", "fresh")),
        "lr": _lr(train),
        "batch": _batch(train, meta.get("world")),
        "code version": model.code_version,
        "trained": model.created[:19].replace("T", " ") + (" UTC" if model.created else ""),
        "evaluated": evaluated,
    }
    if eval_ref:
        rows["evaluation"] = eval_ref
    return rows


def _lr(train: dict) -> str:
    if "lr" not in train:
        return "unknown"
    return f"{train['lr']:g} (warmup {train.get('warmup_steps', '?')}, cosine to {train.get('min_lr', '?')})"


def _batch(train: dict, world) -> str:
    if "micro_batch_size" not in train:
        return "unknown"
    return f"{train['micro_batch_size']} x {train.get('grad_accum_steps', 1)} accum x {world or '?'} ranks"


def report_html(
    metrics: dict[str, float],
    samples: list[dict],
    training_metrics: Path | None,
    deltas: dict[str, float] | None = None,
    identity: dict[str, str] | None = None,
) -> str:
    title = (identity or {}).get("model", "model")
    body = [
        _header(title, identity or {}),
        _summary(metrics),
        _curves(training_metrics),
        _sources_table(metrics),
        _metrics_table(metrics, deltas),
        _samples(samples),
    ]
    data = json.dumps(metrics).replace("</", "<\\/")
    return (
        f"<!doctype html><html lang='en'><head><meta charset='utf-8'>"
        f"<title>liftoff evaluation: {html.escape(title)}</title><style>{STYLE}</style></head>"
        f"<body><main>{''.join(body)}</main>"
        f"<script type='application/json' id='metrics-json'>{data}</script></body></html>"
    )


def _sources_table(metrics: dict[str, float]) -> str:
    """A mixture's sources side by side: each one's val loss, perplexity and bits per byte."""
    sources = sorted(k.split("/", 1)[1] for k in metrics if k.startswith("val_loss/"))
    if not sources:
        return ""
    head = "<tr><th>source</th><th>val loss</th><th>val perplexity</th><th>bits per byte</th></tr>"
    rows = [
        f"<tr><td>{html.escape(s)}</td>"
        + "".join(f"<td>{metrics[f'{k}/{s}']:.4f}</td>" for k in ("val_loss", "val_perplexity", "val_bits_per_byte"))
        + "</tr>"
        for s in [*sources]
    ]
    mixed = "".join(f"<td>{metrics[k]:.4f}</td>" for k in ("val_loss", "val_perplexity", "val_bits_per_byte"))
    rows.append(f"<tr><td>the mixture (by its weights)</td>{mixed}</tr>")
    return f"<section><h2>Per source</h2><table id='sources'>{head}{''.join(rows)}</table></section>"


def _header(title: str, identity: dict[str, str]) -> str:
    return header(f"Evaluation of {title}", identity)


def _summary(metrics: dict[str, float]) -> str:
    shown = [
        ("val_loss", "val loss"),
        ("val_perplexity", "perplexity"),
        ("val_bits_per_byte", "bits/byte"),
        ("perplexity_vs_unigram", "perplexity / unigram"),
    ]
    cards = "".join(
        f"<div class='card'>{label}<b>{metrics[key]:.4g}</b></div>" for key, label in shown if key in metrics
    )
    note = (
        "<p class='note'>perplexity / unigram: the model's val perplexity over that of predicting each val "
        "token from the training tokens' frequencies alone (add-one smoothed); below 1 the model has learnt "
        "more than token frequencies, 1 or above it has not.</p>"
        if "perplexity_vs_unigram" in metrics
        else ""
    )
    return f"<section id='summary'><div class='cards'>{cards}</div>{note}</section>"


def _curves(training_metrics: Path | None) -> str:
    missing = "<section id='curves'><h2>Training</h2><p class='note'>{}</p></section>"
    if training_metrics is None or not training_metrics.is_file():
        return missing.format("the model carries no training records")
    steps, vals = read_timeline(training_metrics)
    if not steps:
        return missing.format("no training steps recorded")
    plots = [
        ("loss", "loss: train" + (" and val (fixed held-out blocks)" if vals else ""), loss_png(steps, vals)),
        ("lr", "learning rate", curve_png(steps, "lr", "learning rate")),
        ("grad_norm", "grad norm (before clipping)", curve_png(steps, "grad_norm", "grad norm")),
        ("tokens_per_s", "throughput (tokens/s)", curve_png(steps, "tokens_per_s", "tokens/s")),
        ("peak_memory", "peak memory (GiB)", curve_png(steps, "peak_memory_bytes", "peak memory (GiB)", 2**-30)),
        ("step_s", "step time (s)", curve_png(steps, "step_s", "step time (s)")),
    ]
    if (load := expert_load_png(steps)) is not None:
        plots.append(("expert_load", "expert load: each expert's share of the routed tokens", load))
    figs = "".join(
        f"<figure><img class='curve' alt='{key}' src='data:image/png;base64,{png}'/>"
        f"<figcaption>{html.escape(caption)}</figcaption></figure>"
        for key, caption, png in plots
    )
    note = "" if vals else "<p class='note'>no validation during training (train.val_interval=0)</p>"
    return f"<section id='curves'><h2>Training</h2><div class='grid'>{figs}</div>{note}</section>"


def _metrics_table(metrics: dict[str, float], deltas: dict[str, float] | None) -> str:
    head = "<tr><th>metric</th><th>value</th>"
    if deltas:
        head += "<th>baseline</th><th>delta vs baseline</th><th>relative</th>"
    rows = []
    for name, value in metrics.items():
        if deltas and name.startswith("baseline_"):
            continue  # shown in the baseline column of its metric
        row = f"<tr><td>{html.escape(name)}</td><td class='num'>{value:.6g}</td>"
        if deltas:
            row += _delta_cells(name, metrics.get(f"baseline_{name}"), deltas.get(name))
        rows.append(row + "</tr>")
    return f"<section><h2>Metrics</h2><table id='metrics'>{head}</tr>{''.join(rows)}</table></section>"


def _delta_cells(name: str, base: float | None, delta: float | None) -> str:
    if delta is None or base is None:
        return "<td></td><td></td><td></td>"
    good = (delta < 0 and name in LOWER_IS_BETTER) or (delta > 0 and name in HIGHER_IS_BETTER)
    bad = (delta > 0 and name in LOWER_IS_BETTER) or (delta < 0 and name in HIGHER_IS_BETTER)
    cls = " better" if good else (" worse" if bad else "")
    rel = f"{delta / base:+.1%}" if base else ""
    return f"<td class='num'>{base:.6g}</td><td class='num{cls}'>{delta:+.6g}</td><td class='num{cls}'>{rel}</td>"


def _samples(samples: list[dict]) -> str:
    if not samples:
        return "<section id='samples'><h2>Samples (greedy)</h2><p class='note'>no prompts (eval.prompts)</p></section>"
    rows = "".join(
        f"<tr><td class='sample'><b>{html.escape(s['prompt'])}</b></td>"
        f"<td class='sample'>{html.escape(s['continuation'])}</td></tr>"
        for s in samples
    )
    return (
        "<section id='samples'><h2>Samples (greedy)</h2><table><tr><th>prompt</th><th>continuation</th></tr>"
        f"{rows}</table></section>"
    )
