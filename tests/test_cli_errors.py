"""Every error path of the command line as a person meets it (issue 43, point 4): `python -m
pipelines.cli` in a directory of its own, and the error is exactly one line on stderr, exit 2,
with nothing of a library's (kfp.Client's FutureWarning, urllib3's `Retrying` lines, INFO
records) around it. No case gets as far as a stage: each is refused in seconds."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from components.config import defaults
from components.store import Ref, open_store
from tests.conftest import ROOT, S3_ACCESS_KEY, S3_SECRET_KEY, free_port
from tests.helpers import CLUSTER, DOCTOR_ROWS

VERSION = "6aa3c0ffee"  # the model version in the store the artifacts cases read


def liftoff(cwd: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`liftoff ARGS` as a person runs it: this checkout first on the path, cwd a directory of its own."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MINIO_ACCESS_KEY": S3_ACCESS_KEY, "MINIO_SECRET_KEY": S3_SECRET_KEY}
    for key in ("KF_PIPELINES_ENDPOINT", "KF_PIPELINES_TOKEN", "KF_PIPELINES_COOKIE"):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "pipelines.cli", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def one_line(proc: subprocess.CompletedProcess) -> str:
    """The one line on stderr of a command that failed with exit 2 and printed nothing else."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    assert proc.stderr.endswith("\n") and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stdout == "", proc.stdout
    return proc.stderr.rstrip("\n")


@pytest.fixture
def workdir(tmp_path) -> Path:
    """The directory the command runs in: no corpus/, no store, no build/ unless a case makes one."""
    work = tmp_path / "work"
    work.mkdir()
    return work


@pytest.fixture
def store_args(tmp_path) -> tuple[object, list[str]]:
    """A small local store holding model/tiny@6aa3c0ffee, published through the store's own API."""
    cfg = defaults("store", root=str(tmp_path / "store"), cache_dir=str(tmp_path / "cache"))
    store = open_store(cfg)
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.safetensors").write_bytes(b"w" * 64)
    store.publish("model", "tiny", VERSION, src, metadata={"final_loss": 5.5})
    return store, [f"store.root={cfg.root}", f"store.cache_dir={cfg.cache_dir}"]


def assert_nothing_ran(workdir: Path) -> None:
    assert sorted(p.name for p in workdir.iterdir()) == [], sorted(workdir.iterdir())  # no runs/, store, build/


# -- the config ---------------------------------------------------------------------------------------


def test_an_unknown_key(workdir):
    line = one_line(liftoff(workdir, "run", "train.bogus=1"))
    assert line.startswith("liftoff run: invalid config: train.bogus is not a config key; the keys of train are ")
    assert_nothing_ran(workdir)


def test_a_value_of_the_wrong_type(workdir):
    line = one_line(liftoff(workdir, "run", "train.steps=abc"))
    assert line == (
        "liftoff run: Error merging override train.steps=abc: Value 'abc' of type 'str' could not be "
        "converted to Integer; full_key: train.steps"
    )
    assert_nothing_ran(workdir)


def test_a_word_no_path_can_be_is_still_an_override_or_a_ref(workdir, store_args):
    """Run folders are told from overrides and refs by looking on disk: a word too long to be a
    file name is looked at, not raised on."""
    long = "x" * 300
    done = liftoff(workdir, "config", f"train.run_dir={long}", "-p", "train.run_dir")
    assert done.returncode == 0 and done.stdout == f"{long}\n" and done.stderr == "", done.stderr
    _, args = store_args
    line = one_line(liftoff(workdir, "artifacts", "show", f"model/{long}", *args))
    assert line.startswith(f"liftoff artifacts: invalid name '{long}': use letters, digits and "), line


# -- liftoff run, refused before any stage ---------------------------------------------------------------


def test_a_missing_data_path_fails_before_any_stage(workdir):
    assert not Path("/nonexistent.jsonl").exists()
    assert one_line(liftoff(workdir, "run", "data.paths=[/nonexistent.jsonl]")) == (
        "liftoff run: data.paths: /nonexistent.jsonl does not exist"
    )
    assert_nothing_ran(workdir)  # no run folder, no local_outputs/, no store: tokenize never started


def test_a_relative_data_path_names_the_directory_it_is_relative_to(workdir):
    """The default config reads corpus/kjv.jsonl from where liftoff runs: elsewhere, it says so."""
    assert one_line(liftoff(workdir, "run")) == (
        f"liftoff run: data.paths: corpus/kjv.jsonl does not exist (relative to {workdir.resolve()})"
    )
    assert_nothing_ran(workdir)


def test_a_model_that_cannot_fit(workdir):
    line = one_line(liftoff(workdir, "run", "model=70b", "preflight.device_memory_gb=24"))
    assert re.fullmatch(
        r"liftoff run: the plan does not fit by [\d.]+ GiB: [\d.]+ GiB per device \(preflight\.memory_headroom=0\.1\)"
        r" > 22\.4 GiB \(this host\); .*; `liftoff plan` with these overrides says more",
        line,
    ), line
    assert_nothing_ran(workdir)


# -- the cluster commands -------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["upload", "submit"])
def test_an_unreachable_kubeflow_pipelines_host(workdir, command):
    """Nothing listens on the port: kfp.Client's FutureWarning and urllib3's three `Retrying`
    lines used to come before the error. (No cluster: the doctor, which would refuse first, is skipped.)"""
    host = f"http://127.0.0.1:{free_port()}"
    line = one_line(liftoff(workdir, command, "--skip-doctor", f"kfp.host={host}", *CLUSTER, timeout=60))
    assert re.fullmatch(
        rf"liftoff {command}: Kubeflow Pipelines at {re.escape(host)}: MaxRetryError: .*Connection refused", line
    ), line


def test_the_doctor_with_nothing_reachable(workdir, monkeypatch):
    """No kubeconfig, nothing on the KFP and store ports: the table on stdout, every row that needs
    an API failing and saying so, and one line on stderr (no traceback, no library's warning)."""
    monkeypatch.setenv("KUBECONFIG", str(workdir.parent / "no-kubeconfig"))
    host, store = f"http://127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    args = [f"kfp.host={host}", f"store.endpoint={store}", "store.timeout_s=1", *CLUSTER]
    proc = liftoff(workdir, "doctor", *args, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    line = proc.stderr.rstrip("\n")
    assert line.startswith(f"liftoff doctor: kfp backend: Kubeflow Pipelines at {host}: MaxRetryError: "), line
    for row in ("pod security", "volcano", "gpu nodes", "nccl"):
        assert f" | {row}: cannot reach the Kubernetes API: ConfigException: " in line, line
    assert f" | store conditional writes: artifact store at {store} unreachable: " in line, line
    table = proc.stdout.splitlines()
    assert table[0].split() == ["check", "status", "found", "fix"] and len(table) == 9, proc.stdout
    assert [r.split("  ")[0] for r in table[1:]] == DOCTOR_ROWS


def test_render_with_the_default_config(workdir):
    assert one_line(liftoff(workdir, "render")) == (
        "liftoff render: render shows the Kubernetes objects of a cluster run, and cluster.scheduler=local_cwd "
        "(this machine) creates none: render a cluster preset on data that fills its steps (liftoff render "
        "experiment=h200-7b data=hub data.hub_revision=<commit>), or use `liftoff compile` for the pipeline alone"
    )
    assert_nothing_ran(workdir)


# -- the store ----------------------------------------------------------------------------------------


def test_an_unknown_ref(workdir, store_args):
    store, args = store_args
    assert one_line(liftoff(workdir, "artifacts", "show", "model/tiny@nope", *args)) == (
        f"liftoff artifacts: no version model/tiny@nope in {store.description}"
    )


def test_an_ambiguous_version_prefix(workdir, store_args):
    store, args = store_args
    src = workdir.parent / "src"
    store.publish("model", "tiny", "6aa3beef", src)
    assert one_line(liftoff(workdir, "artifacts", "show", "model/tiny@6aa3", *args)) == (
        "liftoff artifacts: model/tiny@6aa3 is ambiguous: 2 versions start with '6aa3': "
        f"model/tiny@6aa3beef, model/tiny@{VERSION}"
    )


def test_rm_of_a_pinned_version(workdir, store_args):
    store, args = store_args
    ref = Ref("model", "tiny", VERSION)
    store.pin(ref, reason="release")
    assert one_line(liftoff(workdir, "artifacts", "rm", f"model/tiny@{VERSION[:4]}", *args)) == (
        f"liftoff artifacts: model/tiny@{VERSION} is pinned; nothing removed (unpin, or --force removes "
        "pinned versions too)"
    )
    assert store.exists(ref) and store.is_pinned(ref)


def test_unpin_of_a_version_not_pinned(workdir, store_args):
    _, args = store_args
    assert one_line(liftoff(workdir, "artifacts", "unpin", f"model/tiny@{VERSION}", *args)) == (
        f"liftoff artifacts: model/tiny@{VERSION} is not pinned"
    )


def test_a_store_that_is_not_there(workdir):
    assert (
        one_line(liftoff(workdir, "artifacts", "ls"))
        == "liftoff artifacts: store.root=artifacts: no artifact store there"
    )
    assert_nothing_ran(workdir)


# -- what keeps the terminal quiet ---------------------------------------------------------------------------


def test_library_records_and_warnings_stay_off_the_terminal_and_go_to_a_run_log(tmp_path):
    """The CLI's logging: an INFO record, a library's WARNING or ERROR and a Python FutureWarning
    reach no terminal; liftoff's own ERROR does; inside `liftoff run`'s Console (which points the
    handler at run.log) every record goes to the log."""
    code = """
import logging, warnings
from pathlib import Path
from pipelines.cli import _quiet_terminal
from pipelines.progress import Console
_quiet_terminal()
logging.getLogger("torchx.runner.api").info("tracker configurations: {}")
logging.getLogger("urllib3.connectionpool").warning("Retrying (Retry(total=2))")
logging.getLogger("kfp_server_api.rest").error("a library's error: the one line says what failed")
warnings.warn("This client only works with Kubeflow Pipeline v2.0.0-beta.2", FutureWarning)
logging.getLogger("components.store.artifacts").info("published model/tiny@x")
logging.getLogger("components.store.artifacts").error("an error of liftoff's own")
with Console(Path("run.log")):
    logging.getLogger("urllib3.connectionpool").warning("Retrying inside the run")
    logging.getLogger("components.train.stage").info("published inside the run")
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].endswith(" ERROR components.store.artifacts: an error of liftoff's own"), lines
    log = (tmp_path / "run.log").read_text()
    assert "Retrying inside the run" in log and "published inside the run" in log, log
