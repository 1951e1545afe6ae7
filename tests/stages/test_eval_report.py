"""The eval report as a browser shows it: headless Chromium (Debian's package; `make test`
installs it) renders a report built by the report functions from a run's records, and the
test reads the rendered DOM (identity header, decoded plots) and the screenshot (styled,
plots drawn where the DOM puts them)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from components.evaluate.report import identity_rows, report_html
from components.plots import read_timeline
from components.store import Manifest, Ref
from tests.helpers import HEIGHT, WIDTH, chromium, rendered

PLOTS = {"loss", "lr", "grad_norm", "tokens_per_s", "peak_memory", "step_s"}


def write_run_records(path: Path, steps: int = 60, val_interval: int = 20) -> None:
    """metrics.jsonl as a run with a crash and a resume writes it: steps 1-47, then the rerun
    from the step-40 checkpoint, with val records every val_interval steps."""
    lines = [{"kind": "start", "step": 0, "world": 2, "params": 123456}]

    def step(s: int, rerun: bool) -> None:
        loss = 7 * math.exp(-s / 25) + 2 + (0.05 if rerun else 0) + 0.1 * math.sin(s)
        lines.append(
            {"kind": "step", "step": s, "loss": loss, "grad_norm": 1 / (1 + s / 10), "stepped": True,
             "lr": 3e-3 * min(1, s / 6) * (0.5 + 0.5 * math.cos(math.pi * s / steps)), "skipped_steps": 0,
             "tokens_per_s": 9000 + 300 * math.sin(s / 3), "step_s": 0.05 + 0.01 * (s % 5),
             "peak_memory_bytes": int((1.2 + 0.002 * s) * 2**30), "forward_s": 0.01, "time": 1e9 + s}
        )  # fmt: skip
        if s % val_interval == 0 or s == steps:
            lines.append({"kind": "val", "step": s, "val_loss": loss + 0.3, "val_blocks": 32, "val_s": 0.2})

    for s in range(1, 48):
        step(s, rerun=False)
    lines.append({"kind": "start", "step": 40, "world": 2, "resumed_from": "step-40"})
    for s in range(41, steps + 1):
        step(s, rerun=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))


def fake_model(tmp_path: Path) -> tuple[Manifest, Path]:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    config = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 1024}
    (model_dir / "config.json").write_text(json.dumps(config))
    write_run_records(model_dir / "training_metrics.jsonl")
    train = {"lr": 3e-3, "warmup_steps": 6, "min_lr": 3e-4, "micro_batch_size": 8, "grad_accum_steps": 1}
    manifest = Manifest(
        Ref("model", "tiny", "0123456789abcdef-aabbccddeeff"),
        {},
        {"identity": "0123456789abcdef", "precision": "fp8", "steps": 60, "world": 2, "train": train},
        ["dataset/kjv@feedface"],
        "c0ffee1234567890",
        "2026-12-01T21:00:00.000000+00:00",
    )
    return manifest, model_dir


def build_report(tmp_path: Path) -> Path:
    manifest, model_dir = fake_model(tmp_path)
    metrics = {"val_loss": 5.1, "val_perplexity": 164.0, "val_bits_per_byte": 2.4, "perplexity_vs_unigram": 0.4}
    base = {"val_loss": 5.6, "val_perplexity": 270.4, "val_bits_per_byte": 2.6, "perplexity_vs_unigram": 0.6}
    deltas = {k: metrics[k] - base[k] for k in metrics}
    metrics.update({f"baseline_{k}": v for k, v in base.items()})
    identity = identity_rows(manifest, "dataset/kjv@feedface", model_dir, "2026-12-01 22:00:00 UTC")
    samples = [{"prompt": "In the beginning", "continuation": " God created the heaven <and> the earth"}]
    page = report_html(metrics, samples, model_dir / "training_metrics.jsonl", deltas, identity)
    out = tmp_path / "report.html"
    out.write_text(page)
    return out


def test_the_records_timeline_keeps_the_rerun_of_resumed_steps(tmp_path):
    write_run_records(tmp_path / "m.jsonl")
    steps, vals = read_timeline(tmp_path / "m.jsonl")
    assert [s["step"] for s in steps] == list(range(1, 61))
    assert [v["step"] for v in vals] == [20, 40, 60]
    assert steps[44]["loss"] == pytest.approx(7 * math.exp(-45 / 25) + 2.05 + 0.1 * math.sin(45))  # the rerun's


def test_eval_report_renders_its_identity_header_and_plots(tmp_path):
    from PIL import Image

    report = build_report(tmp_path)
    page = report.read_text()
    assert "<link" not in page and "src='http" not in page and 'src="http' not in page  # self-contained
    probe = rendered(tmp_path, report)

    header = probe["header"]
    for text in ("model/tiny@0123456789abcdef-aabbccddeeff", "0123456789abcdef", "dataset/kjv@feedface",
                 "tiny (2 layers", "fp8", "0.003 (warmup 6", "c0ffee1234567890",
                 "2026-12-01 21:00:00 UTC", "2026-12-01 22:00:00 UTC", "8 x 1 accum x 2 ranks"):  # fmt: skip
        assert text in header, (text, header)
    assert probe["headerBg"] == "rgb(29, 43, 79)"  # the inline stylesheet applied

    imgs = {i["alt"]: i for i in probe["imgs"]}
    assert set(imgs) == PLOTS, imgs
    for img in imgs.values():  # decoded (natural size) and laid out on the page, inside the window
        assert img["w"] > 100 and img["h"] > 100 and img["rw"] > 100 and img["rh"] > 100, img
        assert 0 <= img["x"] and img["x"] + img["rw"] <= WIDTH and 0 <= img["y"] and img["y"] + img["rh"] <= HEIGHT

    shot = tmp_path / "report.png"
    chromium(tmp_path, f"--screenshot={shot}", "--virtual-time-budget=5000", report.as_uri())
    image = Image.open(shot).convert("RGB")
    assert image.size == (WIDTH, HEIGHT)
    assert len(image.getcolors(maxcolors=1 << 20)) > 200  # not a blank page
    assert image.getpixel((WIDTH // 2, 30)) == (29, 43, 79)  # the header band, styled
    for alt, img in imgs.items():
        box = (int(img["x"]) + 2, int(img["y"]) + 2, int(img["x"] + img["rw"]) - 2, int(img["y"] + img["rh"]) - 2)
        region = image.crop(box)
        colors = region.getcolors(maxcolors=1 << 20)
        assert len(colors) > 40, (alt, len(colors))  # axes, labels, antialiased lines: a drawn plot
        blue = sum(n for n, (r, g, b) in colors if abs(r - 31) < 40 and abs(g - 119) < 40 and abs(b - 180) < 40)
        assert blue > 100, (alt, blue)  # matplotlib's first line colour (#1f77b4): the curve itself
        if alt == "loss":
            orange = sum(n for n, (r, g, b) in colors if r > 200 and 90 < g < 160 and b < 60)
            assert orange > 30, orange  # the val-loss line (#ff7f0e)
