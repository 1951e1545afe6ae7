"""Training records and curves, shared by train (its curves) and evaluate (its report)."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path


def read_records(path: Path) -> tuple[list[dict], list[dict]]:
    """(step records, event records) of a metrics.jsonl, every line as written."""
    steps, events = [], []
    for line in Path(path).read_text().splitlines():
        rec = json.loads(line)
        (steps if rec.get("kind") == "step" else events).append(rec)
    return steps, events


def timeline(records: list[dict]) -> tuple[list[dict], list[dict]]:
    """(step records, val records) of the run as it stands. metrics.jsonl is appended to: a
    rerun that trains a step again (a resume from an earlier checkpoint after a crash,
    train.resume=never) replaces the records of that step and of every later one."""
    kept: list[dict] = []  # in step order: a run writes step s, then its val record
    for rec in records:
        kind = rec.get("kind")
        if kind == "step":
            while kept and kept[-1]["step"] >= rec["step"]:
                kept.pop()
        if kind in ("step", "val"):
            kept.append(rec)
    return [r for r in kept if r["kind"] == "step"], [r for r in kept if r["kind"] == "val"]


def read_timeline(path: Path) -> tuple[list[dict], list[dict]]:
    """timeline() of a metrics.jsonl."""
    return timeline([json.loads(line) for line in Path(path).read_text().splitlines()])


def lines_png(
    series: list[tuple[str, list[float], list[float]]], ylabel: str, figsize=(5, 3), styles: list[dict] | None = None
) -> str:
    """A base64 PNG of one or more (label, steps, values) lines against the step; `styles`: each
    line's matplotlib keywords (colour, dashes), in the colour cycle's order without it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=figsize)
    for i, (label, xs, ys) in enumerate(series):
        style = (styles or [{}] * len(series))[i]
        ax.plot(xs, ys, label=label, marker="o" if len(xs) <= 30 else None, markersize=3, **style)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if len(series) > 1:
        ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def curve_png(steps: list[dict], key: str, ylabel: str, scale: float = 1.0) -> str:
    xs = [s["step"] for s in steps if s.get(key) is not None]
    return lines_png([(ylabel, xs, [s[key] * scale for s in steps if s.get(key) is not None])], ylabel)


def loss_png(steps: list[dict], vals: list[dict]) -> str:
    """Train loss per step and, when the run validated (train.val_interval), val loss."""
    series = [("train loss", [s["step"] for s in steps], [s["loss"] for s in steps])]
    if vals:
        series.append(("val loss", [v["step"] for v in vals], [v["val_loss"] for v in vals]))
    return lines_png(series, "loss")


def expert_load_png(steps: list[dict]) -> str | None:
    """A mixture of experts' router balance: each expert's share of the routed tokens per step
    (1 / num_experts each when balanced); None for a model without experts."""
    routed = [s for s in steps if s.get("expert_load")]
    if not routed:
        return None
    xs = [s["step"] for s in routed]
    series = [(f"expert {e}", xs, [s["expert_load"][e] for s in routed]) for e in range(len(routed[0]["expert_load"]))]
    return lines_png(series, "share of routed tokens")
