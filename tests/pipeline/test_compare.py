"""`liftoff compare` on two trained and evaluated runs: what it prints against the store's own
records, and the report as headless Chromium renders it (tables, overlaid curves, styling)."""

from __future__ import annotations

import json

import pytest

from components.config import defaults
from components.evaluate.stage import run_evaluate
from components.store import Ref
from pipelines.cli import main
from tests.conftest import Trainer
from tests.helpers import HEIGHT, WIDTH, chromium, rendered

CURVES = {"loss", "learning rate", "grad norm", "tokens/s"}


@pytest.fixture(scope="module")
def two_runs(dataset_store, tmp_path_factory):
    trainer = Trainer(dataset_store, tmp_path_factory.mktemp("compare"))
    refs = []
    for lr in ("3e-3", "1e-3"):
        model = str(trainer.run("train.steps=12", f"train.lr={lr}", "train.val_interval=6").model.ref)
        run_evaluate(
            model, defaults("eval", val_blocks=8, prompts=["In the beginning"], max_new_tokens=4), trainer.store
        )
        refs.append(model)
    return trainer, refs


def test_compare_prints_config_diffs_and_metric_deltas_from_the_store(two_runs, tmp_path, capsys):
    trainer, refs = two_runs
    store = [f"store.root={trainer.store_cfg.root}", f"store.cache_dir={tmp_path / 'cache'}"]
    out = tmp_path / "compare.html"
    assert main(["compare", *refs, "--out", str(out), *store]) == 0
    lines = capsys.readouterr().out.splitlines()
    lr = next(ln for ln in lines if ln.strip().startswith("train.lr "))
    assert lr.split()[1:] == ["0.003", "0.001"]
    assert not any(ln.strip().startswith("train.steps ") for ln in lines)  # the same in both: not a difference
    evals = {p: m for m in trainer.store.ls("eval") for p in m.parents if p in refs}
    a, b = (evals[r].metadata["metrics"]["val_loss"] for r in refs)
    row = next(ln for ln in lines if ln.strip().startswith("val_loss ")).split()
    assert float(row[1]) == pytest.approx(a, rel=1e-3) and float(row[2]) == pytest.approx(b, rel=1e-3)
    assert float(row[3]) == pytest.approx(b - a, abs=1e-3)
    assert lines[-1] == f"report: {out}"
    machine = json.loads(out.read_text().split("id='data'>", 1)[1].split("</script>", 1)[0])
    assert machine["B"]["metrics"]["val_loss"] == b


def test_compare_report_renders_both_runs_overlaid(two_runs, tmp_path):
    from PIL import Image

    trainer, refs = two_runs
    out = tmp_path / "compare.html"
    store = [f"store.root={trainer.store_cfg.root}", f"store.cache_dir={tmp_path / 'cache'}"]
    assert main(["compare", *refs, "--out", str(out), *store]) == 0
    probe = rendered(tmp_path, out)
    assert refs[0] in probe["header"] and refs[1] in probe["header"]
    assert probe["headerBg"] == "rgb(29, 43, 79)"  # the inline stylesheet applied
    imgs = {i["alt"]: i for i in probe["imgs"]}
    assert set(imgs) == CURVES, imgs
    for img in imgs.values():  # decoded and laid out inside the window
        assert img["w"] > 100 and img["h"] > 100 and img["rw"] > 100, img
        assert 0 <= img["x"] and img["x"] + img["rw"] <= WIDTH and img["y"] + img["rh"] <= HEIGHT

    shot = tmp_path / "compare.png"
    chromium(tmp_path, f"--screenshot={shot}", "--virtual-time-budget=5000", out.as_uri())
    image = Image.open(shot).convert("RGB")
    assert image.getpixel((WIDTH // 2, 30)) == (29, 43, 79)  # the header band
    for alt, img in imgs.items():
        box = (int(img["x"]) + 2, int(img["y"]) + 2, int(img["x"] + img["rw"]) - 2, int(img["y"] + img["rh"]) - 2)
        colors = image.crop(box).getcolors(maxcolors=1 << 20)
        blue = sum(n for n, (r, g, bl) in colors if abs(r - 31) < 40 and abs(g - 119) < 40 and abs(bl - 180) < 40)
        orange = sum(n for n, (r, g, bl) in colors if r > 200 and 90 < g < 160 and bl < 60)
        assert blue > 50 and orange > 50, (alt, blue, orange)  # run A's line and run B's, in one plot


def test_compare_names_a_ref_that_is_not_there_in_one_line(two_runs, tmp_path, capsys):
    trainer, refs = two_runs
    store = [f"store.root={trainer.store_cfg.root}"]
    missing = str(Ref("model", "tiny", "0" * 16 + "-" + "0" * 12))
    assert main(["compare", refs[0], missing, "--out", str(tmp_path / "c.html"), *store]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and missing in err[0]
    assert not (tmp_path / "c.html").exists()
