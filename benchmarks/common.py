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


def steady_rate(stamps: dict[int, float], tokens_per_step: int, window: tuple[int, int]) -> float:
    """tokens/s over the steps in (start, end] of `window`, from {step: the time it ended}."""
    start, end = window
    return tokens_per_step * (end - start) / (stamps[end] - stamps[start])


def report_interleaved(name: str, ours: list[float], baseline: list[float], sides: tuple[str, str], **extra) -> None:
    """Runs interleaved ours, baseline, ours, ...: the best of each side against the other (tokens/s),
    and the spread of the per-pair ratios (single runs on a shared VM move by +-10%)."""
    pairs = [o / b for o, b in zip(ours, baseline, strict=True)]
    print(f"runs: {sides[0]} {[round(r) for r in ours]}, {sides[1]} {[round(r) for r in baseline]} tokens/s")
    print(f"best: {sides[0]} {max(ours):,.0f} vs {sides[1]} {max(baseline):,.0f} tokens/s; pair ratios {pairs}")
    report(name, max(ours), max(baseline), "tokens/s", runs=len(ours), **extra,
           pair_ratio_min=min(pairs), pair_ratio_max=max(pairs))  # fmt: skip


def report(name: str, value: float, baseline: float, unit: str, **extra) -> None:
    """The last line every benchmark prints."""
    print(
        json.dumps(
            {"name": name, "value": value, "baseline": baseline, "ratio": value / baseline, "unit": unit, **extra}
        )
    )
