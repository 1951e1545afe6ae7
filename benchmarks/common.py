"""Helpers the benchmarks share."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "corpus" / "kjv.jsonl"

# the training benchmarks' model and batch: a 4-layer, 256-wide Llama, 16 sequences a micro-batch
TRAIN_SHAPE = [
    "model.hidden_size=256",
    "model.num_layers=4",
    "model.num_heads=4",
    "model.num_kv_heads=4",
    "model.ffn_hidden_size=768",
    "train.micro_batch_size=16",
]


def rss_mb(kind: str = "VmRSS") -> float:
    """Resident memory from /proc/self/status: VmRSS (all), RssAnon (heap) or RssFile (mapped files)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{kind}:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {kind} in /proc/self/status")


def report(name: str, value: float, baseline: float, unit: str, **extra) -> None:
    """The last line every benchmark prints."""
    print(
        json.dumps(
            {"name": name, "value": value, "baseline": baseline, "ratio": value / baseline, "unit": unit, **extra}
        )
    )
