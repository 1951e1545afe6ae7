"""Training curves and summary numbers from metrics.jsonl, for the Kubeflow UI."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from components import page
from components.plots import curve_png, expert_load_png, loss_png, read_records, read_timeline, timeline


def final_metrics(path: Path) -> dict[str, float]:
    steps, events = read_records(path)
    last = steps[-1]
    tail = steps[len(steps) // 2 :]
    out = {
        "final_loss": last["loss"],
        "initial_loss": steps[0]["loss"],
        "steps": last["step"],
        "skipped_steps": last["skipped_steps"],
        "tokens_per_s": statistics.median(s["tokens_per_s"] for s in tail),
        "peak_memory_gb": max(s["peak_memory_bytes"] for s in steps) / 1e9,
        "loss_spikes": sum(e["kind"] == "loss_spike" for e in events),
        "stragglers_reported": sum(e["kind"] == "straggler" for e in events),
    }
    start = next((e for e in events if e["kind"] == "start"), {})
    out["float8_linear_count"] = start.get("float8_linear_count", 0)  # read from the model that trained
    mfus = [s["mfu"] for s in tail if s.get("mfu") is not None]
    if mfus:
        out["mfu"] = statistics.median(mfus)
    _, vals = read_timeline(path)
    if vals:
        out["final_val_loss"] = vals[-1]["val_loss"]
    return out


def curves_html(path: Path, identity: dict[str, str] | None = None) -> str:
    """The run's curves as the Kubeflow UI shows them: the run's identity, then loss (train and
    val), lr, grad norm, throughput, memory and step time, then the events it recorded."""
    records = [json.loads(line) for line in Path(path).read_text().splitlines()]
    steps, vals = timeline(records)
    plots = [
        (loss_png(steps, vals), "loss (train and val)"),
        (curve_png(steps, "lr", "learning rate"), "learning rate"),
        (curve_png(steps, "grad_norm", "grad norm"), "grad norm"),
        (curve_png(steps, "tokens_per_s", "tokens/s"), "tokens/s"),
        (curve_png(steps, "peak_memory_bytes", "peak memory (GiB)", 2**-30), "peak memory"),
        (curve_png(steps, "step_s", "step time (s)"), "step time"),
    ]
    if (load := expert_load_png(steps)) is not None:
        plots.append((load, "expert load (router balance)"))
    events = [r for r in records if r.get("kind") not in ("step", "val")]
    rows = [[e["kind"], e.get("step", ""), _details(e)] for e in events]
    title = (identity or {}).get("training run", "training run")
    body = [
        page.header(f"Training curves of {title}", identity or {}),
        page.section("curves", "Curves", page.figures(plots)),
        page.section("events", "Events", page.table(["event", "step", "details"], rows, numeric_from=9)),
    ]
    return page.page(f"liftoff training: {title}", body)


def _details(event: dict) -> str:
    """`key value, key value` of an event record, numbers short, lists abridged."""

    def short(v) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        if isinstance(v, list):
            return f"{len(v)} items" if len(v) > 4 else ", ".join(map(str, v))
        if isinstance(v, dict):
            return "{" + ", ".join(f"{k}: {short(x)}" for k, x in v.items()) + "}"
        return str(v)

    return "; ".join(f"{k} {short(v)}" for k, v in event.items() if k not in ("kind", "step", "time"))
