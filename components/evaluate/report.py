"""The evaluate report for the Kubeflow UI: training curves, metrics table, samples."""

from __future__ import annotations

import html
import json
from pathlib import Path

from components.plots import curve_png, read_records


def report_html(
    metrics: dict[str, float],
    samples: list[dict],
    training_metrics: Path | None,
    deltas: dict[str, float] | None = None,
) -> str:
    parts = ["<html><head><meta charset='utf-8'><title>liftoff evaluation</title></head><body>", "<h1>Evaluation</h1>"]
    if training_metrics is not None and training_metrics.is_file():
        steps, _ = read_records(training_metrics)
        parts.append("<h2>Training curves</h2>")
        for key, label in [
            ("loss", "train loss"),
            ("lr", "learning rate"),
            ("grad_norm", "grad norm"),
            ("tokens_per_s", "tokens/s"),
        ]:
            parts.append(f'<img class="curve" alt="{key}" src="data:image/png;base64,{curve_png(steps, key, label)}"/>')
    parts.append(
        '<h2>Metrics</h2><table id="metrics" border="1"><tr><th>metric</th><th>value</th>'
        + ("<th>delta vs baseline</th>" if deltas else "")
        + "</tr>"
    )
    for name, value in metrics.items():
        delta = f"<td>{deltas[name]:+.6g}</td>" if deltas and name in deltas else ("<td></td>" if deltas else "")
        parts.append(f"<tr><td>{html.escape(name)}</td><td>{value:.6g}</td>{delta}</tr>")
    parts.append("</table><h2>Samples (greedy)</h2><ul>")
    for s in samples:
        parts.append(f"<li><b>{html.escape(s['prompt'])}</b>{html.escape(s['continuation'])}</li>")
    parts.append(
        "</ul><script type='application/json' id='metrics-json'>"
        + html.escape(json.dumps(metrics))
        + "</script></body></html>"
    )
    return "".join(parts)
