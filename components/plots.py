"""Training records and curves, shared by train (its curves) and evaluate (its report)."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path


def read_records(path: Path) -> tuple[list[dict], list[dict]]:
    """(step records, event records) of a metrics.jsonl."""
    steps, events = [], []
    for line in Path(path).read_text().splitlines():
        rec = json.loads(line)
        (steps if rec.get("kind") == "step" else events).append(rec)
    return steps, events


def curve_png(steps: list[dict], key: str, ylabel: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3))
    ax.plot([s["step"] for s in steps], [s[key] for s in steps])
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()
