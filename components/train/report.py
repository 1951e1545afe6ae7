"""Training curves and summary numbers from metrics.jsonl, for the Kubeflow UI."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from components.plots import curve_png, loss_png, read_records, read_timeline, timeline


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


def curves_html(path: Path) -> str:
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
    imgs = "".join(
        f'<figure><img alt="{label}" src="data:image/png;base64,{png}"/><figcaption>{label}</figcaption></figure>'
        for png, label in plots
    )
    events = [r for r in records if r.get("kind") not in ("step", "val")]
    rows = "".join(
        f"<tr><td>{e['kind']}</td><td>{json.dumps({k: v for k, v in e.items() if k != 'kind'})}</td></tr>"
        for e in events
    )
    return (
        f"<html><body><h2>Training curves</h2>{imgs}<h3>Events</h3>"
        f"<table border=1><tr><th>event</th><th>details</th></tr>{rows}</table></body></html>"
    )
