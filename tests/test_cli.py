"""The command line as a person meets it: help, config listings, artifacts ls/show/get, closed pipes."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from components.config import CONF_DIR, defaults
from components.store import KINDS, open_store
from pipelines.artifacts import human_size, when
from pipelines.cli import COMMANDS, main
from pipelines.compare import RUNTIME_ONLY
from tests.helpers import cli

ROOT = Path(__file__).resolve().parent.parent


def test_help_lists_every_command_on_one_line(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in COMMANDS:
        lines = [ln for ln in out.splitlines() if ln.startswith(f"  {name} ")]
        assert len(lines) == 1 and len(lines[0].split(maxsplit=1)) == 2, (name, out)
    assert set(COMMANDS) == {
        "config",
        "run",
        "plan",
        "artifacts",
        "nodes",
        "compile",
        "render",
        "doctor",
        "upload",
        "submit",
        "profile",
        "compare",
    }


def test_no_command_is_usage_on_stderr_exit_2(capsys):
    assert main([]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "usage: liftoff COMMAND" in captured.err


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_each_command_has_its_own_help(command, flag, capsys):
    """Help is answered before anything composes or runs: `run --help` starts no pipeline."""
    assert main([command, flag, "model=no-such-model"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith(f"usage: liftoff {command} ") and captured.err == ""


def test_run_help_through_the_entry_point():
    done = cli("run", "--help", timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: liftoff run [-m] [overrides]") and "Traceback" not in done.stderr


def test_help_command_names_one_command(capsys):
    assert main(["help", "artifacts"]) == 0
    assert capsys.readouterr().out.startswith("usage: liftoff artifacts ls [KIND] | show KIND/NAME")


def test_cfg_job_prints_the_composed_config(capsys):
    assert main(["config", "train.lr=0.01"]) == 0
    plain = capsys.readouterr().out
    assert main(["config", "--cfg", "job", "train.lr=0.01"]) == 0
    assert capsys.readouterr().out == plain and "lr: 0.01" in plain
    assert main(["config", "--cfg=job", "-p", "train.lr", "train.lr=0.01"]) == 0
    assert capsys.readouterr().out == "0.01\n"
    assert main(["config", "--cfg", "job", "--package", "model", "model=7b"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("name: 7b\n") and "hidden_size: 4096" in out and "train" not in out


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--cfg", "hydra"], "--cfg takes job"),
        (["--cfg"], "--cfg needs a value"),
        (["-p", "train.nope"], "--package 'train.nope' names no part"),
        (["--info", "plugins"], "--info takes groups"),
    ],
)
def test_config_flags_fail_in_one_line(args, needle, capsys):
    assert main(["config", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("liftoff config: ") and needle in err and len(err.splitlines()) == 1


def test_info_groups_lists_each_group_and_its_options(capsys):
    assert main(["config", "--info", "groups"]) == 0
    out = capsys.readouterr().out
    rows = {ln.split()[0]: ln.split(maxsplit=1)[1] for ln in out.splitlines()[1:]}
    folders = {d.name: sorted(f.stem for f in d.glob("*.yaml")) for d in CONF_DIR.iterdir() if d.is_dir()}
    assert set(rows) == set(folders) and {"model", "store", "cluster", "experiment"} <= set(rows)
    for group, options in folders.items():
        assert rows[group].replace("*", "").split(", ") == options
    assert "tiny*" in rows["model"] and "125m" in rows["model"] and "local*" in rows["store"]
    assert rows["store"].count("*") == 1


# -- artifacts ---------------------------------------------------------------------------


@pytest.fixture
def shelf(tmp_path):
    """A local store with a dataset (two files, 2 KiB + 2 B) and a model made from it."""
    cfg = defaults("store", root=str(tmp_path / "store"), cache_dir=str(tmp_path / "cache"))
    store = open_store(cfg)
    d = tmp_path / "d"
    (d / "sub").mkdir(parents=True)
    (d / "a.bin").write_bytes(b"a" * 2048)
    (d / "sub" / "b.txt").write_text("hi")
    store.publish("dataset", "kjv", "h1", d, metadata={"tokens": 12345, "split": {"train": 0.9}, "paths": ["x"]})
    m = tmp_path / "m"
    m.mkdir()
    (m / "model.safetensors").write_bytes(b"w" * (3 * 1024 * 1024))
    parents = ["dataset/kjv@h1", "checkpoint/tiny@gone"]
    store.publish("model", "tiny", "r1", m, metadata={"final_loss": 5.49}, parents=parents)
    return store, [f"store.root={cfg.root}", f"store.cache_dir={cfg.cache_dir}"]


def test_human_sizes_and_dates():
    assert [human_size(n) for n in (0, 512, 1536, 3 * 2**20, 5 * 2**30)] == [
        "0 B",
        "512 B",
        "1.5 KiB",
        "3.0 MiB",
        "5.0 GiB",
    ]
    assert when("2026-12-01T21:56:10.123456+00:00") == "2026-12-01 21:56"
    assert when("2026-12-01T23:56:10+02:00") == "2026-12-01 21:56"


def test_ls_prints_human_sizes_and_dates(shelf, capsys):
    store, args = shelf
    assert main(["artifacts", "ls", *args]) == 0
    lines = capsys.readouterr().out.splitlines()
    date = r"\d{4}-\d\d-\d\d \d\d:\d\d"
    assert re.fullmatch(rf"dataset/kjv@h1  {date}  2 files     2\.0 KiB", lines[0]), lines
    assert re.fullmatch(rf"model/tiny@r1   {date}   1 file     3\.0 MiB", lines[1]), lines
    assert len(lines) == 2
    assert main(["artifacts", "ls", "model", *args]) == 0
    assert capsys.readouterr().out.startswith("model/tiny@r1  ")


@pytest.mark.parametrize(
    "words,needle",
    [
        (["ls", "bogus"], f"unknown artifact kind 'bogus'; the kinds are {', '.join(sorted(KINDS))}"),
        (["show", "bogus/x"], "unknown artifact kind 'bogus'"),
        (["show", "model"], "usage: liftoff artifacts show KIND/NAME[@VERSION]: 'model' names no artifact"),
        (["show", "model/"], "'model/' names no artifact"),
        (["show", "model/tiny@"], "'model/tiny@' is not an artifact reference"),
        (["show"], "usage: liftoff artifacts show KIND/NAME[@VERSION]"),
        (["get", "model"], "usage: liftoff artifacts get KIND/NAME[@VERSION]"),
        (["show", "model/tiny@r9"], "no version model/tiny@r9"),
        (["frob"], "usage: liftoff artifacts ls [KIND] | show"),
    ],
)
def test_bad_kinds_and_names_are_one_line_exit_2(shelf, words, needle, capsys):
    _, args = shelf
    assert main(["artifacts", *words, *args]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("liftoff artifacts: ") and needle in captured.err, captured.err
    assert len(captured.err.splitlines()) == 1 and captured.out == ""


def test_show_model_without_a_name_lists_the_names_there_are(shelf, capsys):
    _, args = shelf
    assert main(["artifacts", "show", "model", *args]) == 2
    assert capsys.readouterr().err.rstrip().endswith(": tiny)")


def test_show_is_a_readable_summary(shelf, capsys):
    store, args = shelf
    assert main(["artifacts", "show", "dataset/kjv", *args]) == 0
    out = capsys.readouterr().out
    manifest = store.resolve("dataset", "kjv")
    lines = out.splitlines()
    assert lines[0] == "dataset/kjv@h1"
    assert re.fullmatch(r"  created\s+\d{4}-\d\d-\d\d \d\d:\d\d UTC", lines[1])
    assert lines[2].split() == ["code", "version", manifest.code_version]
    for row in ('    paths: ["x"]', "    split.train: 0.9", "    tokens: 12345"):
        assert row in lines
    assert re.search(r"^  files\s+2, 2\.0 KiB$", out, re.M)
    assert re.search(rf"^    a\.bin\s+2\.0 KiB  sha256 {manifest.files['a.bin']['sha256'][:12]}$", out, re.M)
    assert re.search(r"^    sub/b\.txt\s+2 B  sha256 ", out, re.M)
    assert "{" not in out  # no raw JSON


def test_show_draws_the_lineage_tree(shelf, capsys):
    _, args = shelf
    assert main(["artifacts", "show", "model/tiny@r1", *args]) == 0
    lines = capsys.readouterr().out.splitlines()
    tree = lines[lines.index("  lineage") + 1 :]
    assert tree[0].startswith("    model/tiny@r1  created ")
    assert tree[1].startswith("      dataset/kjv@h1  created ")
    assert tree[2] == "      checkpoint/tiny@gone  (missing from the store)"
    assert "    final_loss: 5.49" in lines


def test_show_json_is_the_raw_manifest(shelf, capsys):
    import json

    store, args = shelf
    assert main(["artifacts", "show", "model/tiny", "--json", *args]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(store.resolve("model", "tiny").to_json())


def test_get_downloads_verified_into_dest(shelf, tmp_path, monkeypatch, capsys):
    store, args = shelf
    monkeypatch.chdir(tmp_path)
    assert main(["artifacts", "get", "dataset/kjv", *args]) == 0
    default = tmp_path / "dataset-kjv-h1"
    assert capsys.readouterr().out == f"{default}\n"
    assert (default / "a.bin").read_bytes() == b"a" * 2048 and (default / "sub" / "b.txt").read_text() == "hi"
    assert main(["artifacts", "get", "model/tiny@r1", "out/model", *args]) == 0
    assert capsys.readouterr().out == f"{tmp_path / 'out' / 'model'}\n"
    assert (tmp_path / "out" / "model" / "model.safetensors").stat().st_size == 3 * 1024 * 1024


def test_get_refuses_a_corrupt_object(shelf, tmp_path, capsys):
    store, args = shelf
    (Path(store.backend.root) / "dataset" / "kjv" / "h1" / "a.bin").write_bytes(b"b" * 2048)
    assert main(["artifacts", "get", "dataset/kjv@h1", str(tmp_path / "got"), *args]) == 2
    captured = capsys.readouterr()
    assert "sha256 mismatch for dataset/kjv/h1/a.bin" in captured.err and captured.out == ""
    assert len(captured.err.splitlines()) == 1 and not (tmp_path / "got" / "a.bin").exists()


def test_get_into_a_file_is_one_line(shelf, tmp_path, capsys):
    _, args = shelf
    (tmp_path / "file").write_text("x")
    assert main(["artifacts", "get", "model/tiny", str(tmp_path / "file"), *args]) == 2
    assert "exists and is not a directory" in capsys.readouterr().err


class ClosedPipe(io.StringIO):
    def write(self, s: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")


def test_a_closed_pipe_is_quiet(shelf, monkeypatch, capsys):
    _, args = shelf
    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    assert main(["artifacts", "ls", *args]) == 141
    assert capsys.readouterr().err == ""


def test_a_reader_that_leaves_early_gets_no_traceback(shelf, tmp_path):
    """`liftoff artifacts ls | head -1` with the reader gone before the first write."""
    _, args = shelf
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(tmp_path / "stderr", "w+") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pipelines.cli", "artifacts", "ls", *args],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=err,
        )
        proc.stdout.close()
        assert proc.wait(timeout=120) == 141
        err.seek(0)
        text = err.read()
    assert "Traceback" not in text and "BrokenPipe" not in text and "Exception ignored" not in text, text


# -- compare and run folders, without training ---------------------------------------------------------


def _train_config(**changed) -> dict:
    """A model's `train` metadata as the train stage records it (every TrainConfig key)."""
    import dataclasses

    from components.config import as_plain_dict

    return {**as_plain_dict(dataclasses.replace(defaults("train"))), **changed}


@pytest.fixture
def two_models(tmp_path):
    """A local store with model/tiny@aaaa1111 (lr 3e-3, 10 steps, evaluated twice: e-old, then
    e-new) and model/tiny@bbbb2222 (lr 1e-3, 20 steps, activation checkpointing, evaluated
    once), whose runtime-only settings (metrics port, run dir, log interval, checkpoint keep)
    differ too; and the run folder `liftoff run` left for the first model's first evaluation."""
    from components.evaluate.report import identity_rows, report_html

    cfg = defaults("store", root=str(tmp_path / "store"), cache_dir=str(tmp_path / "cache"))
    store = open_store(cfg)
    src = tmp_path / "src"
    src.mkdir()
    (src / "x.bin").write_bytes(b"x")
    store.publish("dataset", "kjv", "h1", src)
    runtime = [  # the second run also checkpoints activations: outside the identity, yet it changes memory and speed
        {"metrics_port": 0, "run_dir": "runs", "log_interval": 10, "checkpoint_keep": 2},
        {
            "metrics_port": 9400,
            "run_dir": "/scratch/runs",
            "log_interval": 1,
            "checkpoint_keep": 5,
            "activation_checkpointing": "full",
        },
    ]
    models = []
    for version, lr, steps, extra in (("aaaa1111", 3e-3, 10, runtime[0]), ("bbbb2222", 1e-3, 20, runtime[1])):
        meta = {"train": _train_config(lr=lr, steps=steps, **extra), "steps": steps, "precision": "fp32", "world": 1}
        models.append(store.publish("model", "tiny", version, src, metadata=meta, parents=["dataset/kjv@h1"]))
    evals = {}
    for version, model, loss in (("e-old", models[0], 5.0), ("e-new", models[0], 4.5), ("eb", models[1], 4.0)):
        meta = {"metrics": {"val_loss": loss, "val_perplexity": 2.0**loss}}
        evals[version] = store.publish("eval", "tiny", version, src, metadata=meta, parents=[str(model.ref)])
        time.sleep(0.01)  # created stamps in order: the newest evaluation of model A is e-new
    folder = tmp_path / "runs" / "tiny" / "2026-12-07_10-00-00_lr=3e-3"
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "config.yaml").write_text("{}\n")
    identity = identity_rows(models[0], "dataset/kjv@h1", None, "2026-12-07 10:05 UTC", "eval/tiny@e-old")
    (folder / "eval_report.html").write_text(report_html({"val_loss": 5.0}, [], None, identity=identity))
    return store, [f"store.root={cfg.root}", f"store.cache_dir={cfg.cache_dir}"], folder


def test_show_takes_a_run_folder_for_its_model(two_models, tmp_path, monkeypatch, capsys):
    """As a person types it: relative, its name holding an override (`lr=3e-3`) and a slash."""
    _, args, folder = two_models
    monkeypatch.chdir(tmp_path)
    relative = str(folder.relative_to(tmp_path)) + "/"
    assert main(["artifacts", "show", relative, *args]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "model/tiny@aaaa1111"


def test_a_run_folder_that_did_not_finish_names_no_model_in_one_line(two_models, capsys):
    _, args, folder = two_models
    (folder / "eval_report.html").unlink()
    assert main(["artifacts", "show", str(folder), *args]) == 2
    captured = capsys.readouterr()
    assert captured.err == (
        f"liftoff artifacts: run folder {folder} holds no eval_report.html: its run did not finish "
        "(its run.log says why)\n"
    )


def test_compare_lists_each_differing_key_once_and_no_runtime_only_key(two_models, tmp_path, capsys):
    _, args, _ = two_models
    out = tmp_path / "c.html"
    assert main(["compare", "model/tiny@aaaa1111", "model/tiny@bbbb2222", "--out", str(out), *args]) == 0
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("config: "))
    end = next(i for i, ln in enumerate(lines) if ln.startswith("metrics:"))
    differ = [ln.split()[0] for ln in lines[start + 1 : end]]
    # not `steps` again, not the port, run dir, log interval or checkpoint keep; what changes results, yes
    assert differ == ["train.activation_checkpointing", "train.lr", "train.steps"], lines
    kept = [k for k in _train_config() if k not in RUNTIME_ONLY]
    assert {"metrics_port", "run_dir", "log_interval", "checkpoint_keep"} & set(kept) == set()
    assert lines[start] == f"config: 3 of {len(kept) + 3} keys differ"  # train.*, world, dataset, started


def test_compare_takes_prefixes_latest_and_run_folders(two_models, tmp_path, capsys):
    """A run folder stands for its own evaluation (e-old), where the model's ref gets its newest
    (e-new); `tiny@latest` is model/tiny's newest version; a prefix names the one version."""
    _, args, folder = two_models
    out = ["--out", str(tmp_path / "c.html")]
    assert main(["compare", str(folder), "tiny@latest", *out, *args]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == [
        "A: model/tiny@aaaa1111  (eval eval/tiny@e-old)",
        "B: model/tiny@bbbb2222  (eval eval/tiny@eb)",
    ]
    assert main(["compare", "model/tiny@aaaa", "model/tiny@bb", *out, *args]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == [
        "A: model/tiny@aaaa1111  (eval eval/tiny@e-new)",
        "B: model/tiny@bbbb2222  (eval eval/tiny@eb)",
    ]
