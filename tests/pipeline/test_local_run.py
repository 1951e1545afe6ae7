"""`liftoff run`: the whole DAG through kfp.local, with MinIO over HTTP and with the local store."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pipelines.cli import main
from tests.conftest import split_corpus, upload_corpus
from tests.helpers import FAST, TOY


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def executed(out: str) -> list[str]:
    return re.findall(r"Executing task \S*'([\w-]+)'", out)


def run_logs(root) -> str:
    """Every run's full log under `root` (kfp.local's and the replicas' lines), oldest first."""
    return "".join(p.read_text() for p in sorted(root.rglob("run.log"), key=lambda p: p.stat().st_mtime))


@pytest.mark.chaos_slow  # 90 s, two whole runs: in `make chaos`; test_run_end_to_end_over_minio keeps a one-job sweep
def test_sweep_runs_every_job_tokenizes_once_and_reruns_only_what_changed(in_tmp, capfd, caplog):
    caplog.set_level("INFO")
    assert main(["run", "-m", *FAST, "train.lr=1e-3,3e-3"]) == 0
    out = capfd.readouterr().out
    (sweep,) = (in_tmp / "multirun").glob("*/*")  # multirun/<date>/<time>/, one folder per job
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0", "1"]
    assert "train.lr=0.003" in (sweep / "1" / ".hydra" / "overrides.yaml").read_text()
    logs = run_logs(sweep)
    # the plan always runs (the bytes behind a path may change); it finds the dataset stored, and
    # the second job's shard task is a cache hit
    assert executed(logs).count("tokenize-plan") == 2 and executed(logs).count("tokenize-shard") == 1
    assert "Task tokenize-shard cache hit" in caplog.text
    assert re.search(r"^\s+ok [\d.]+ s, dataset/kjv@\w+: .* found in the store", out, re.M)
    assert executed(logs).count("train") == 2 and executed(logs).count("validate") == 2
    assert executed(logs).count("evaluate") == 2 and executed(logs).count("preflight") == 2
    header = (
        "| job | overrides | model | started | train loss | val loss | val perplexity | tokens/s | wall s | reused |"
    )
    assert header in out and (sweep / "sweep.md").read_text().startswith(header)
    table = [line.split(" | ") for line in out.splitlines() if re.match(r"\| [01] \|", line)]
    assert len(table) == 2 and "train.lr=0.001" in table[0][1] and "train.lr=0.003" in table[1][1]
    for row in table:
        assert re.fullmatch(r"[0-9a-f]{16}-\w+", row[2]) and row[3] == "fresh" and float(row[4]) > 0
        assert row[-1] == "no |"
    assert table[0][2] != table[1][2]  # two learning rates, two models
    assert main(["artifacts", "ls", "dataset"]) == 0
    assert len([ln for ln in capfd.readouterr().out.splitlines() if ln.startswith("dataset/")]) == 1


def test_run_end_to_end_over_minio_traces_lineage_and_reuses_the_dataset(in_tmp, s3_env, capfd):
    """The default experiment with MinIO over HTTP as the store and a multi-file corpus as objects
    under an s3:// prefix on its endpoint, fanned out into 4 shard tasks (dsl.ParallelFor, merged
    with dsl.Collected) that training streams from the store."""
    from components.config import StoreBackend, defaults
    from components.store import Ref, open_store

    cfg = defaults("store", backend=StoreBackend.minio, bucket="e2e-run", root="", cache_dir=str(in_tmp / ".probe"))
    source = upload_corpus(cfg, "e2e-corpus", split_corpus(in_tmp / "corpus", parts=4), "kjv")
    on_minio = ["store=minio", "store.bucket=e2e-run", "store.timeout_s=10"]
    sharded = [f"data.paths=[{source}]", "data.shards=4", *FAST[1:], *on_minio]
    assert main(["run", *sharded]) == 0
    out = capfd.readouterr().out
    assert executed(run_logs(in_tmp / "runs")).count("tokenize-shard") == 4
    assert re.search(r"^\s+ok [\d.]+ s, shard/kjv@\w+-3of4", out, re.M)
    assert "val_perplexity:" in out and "artifacts (each <- what it was made from):" in out
    report = re.search(r"^report: (\S+)$", out, re.M).group(1)  # the summary's last line
    assert out.rstrip().endswith(report) and report.endswith(".html")
    assert "<header id='identity'>" in Path(report).read_text()
    model_ref = re.search(r"^  (model/tiny@[\w-]+)  <- ", out, re.M).group(1)
    assert main(["artifacts", "show", model_ref, *on_minio]) == 0
    shown = capfd.readouterr().out
    assert re.search(r"^      checkpoint/tiny@\w+-step10", shown, re.M)  # the lineage tree, under the model
    assert re.search(r"^      dataset/kjv@\w+", shown, re.M)
    assert re.search(r"^    model/tiny@[\w-]+ .* code [0-9a-f]{40}", shown, re.M)  # the commit that trained it
    # the default experiment is the headline path: 2 nodes, fp8 Float8Linears, activation checkpointing
    store = open_store(cfg)  # the bucket, read by a client of the test's own
    trained = store.manifest(Ref.parse(model_ref)).metadata
    assert trained["world"] == 2 and trained["float8_linear_count"] == 14
    assert trained["wrapped_modules"]["activation_checkpoint"] == 2
    assert [m.metadata["passed"] for m in store.ls("preflight-report")] == [True]  # its report, as HTML
    files = store.manifest(Ref.parse(model_ref)).files  # the training records and events travel with the model
    assert "training_metrics.jsonl" in files and any(f.startswith("tensorboard/events.out.tfevents.") for f in files)
    assert not (in_tmp / "artifacts").exists()  # nothing went to a local store
    # a new kfp.local root (as on a fresh machine) still finds the dataset in the store; run as a
    # one-job sweep, its table flags the model as the one the first run made
    import shutil

    parents = store.manifest(Ref.parse(model_ref)).parents
    dataset = store.manifest(Ref.parse(next(p for p in parents if p.startswith("dataset/"))))
    assert len(dataset.metadata["shards"]) == 4 and dataset.parents[1:] == [
        s["ref"] for s in dataset.metadata["shards"]
    ]
    shutil.rmtree(in_tmp / "local_outputs")
    assert main(["run", "-m", *sharded]) == 0
    assert "reusing it, no tokenization" in run_logs(in_tmp / "multirun")
    again = capfd.readouterr().out
    row = next(line for line in again.splitlines() if line.startswith("| 0 |"))
    assert model_ref.split("@")[1] in row and row.endswith("| yes (same model as before) |")
    # issue 43, point 1: the rerun resumes at its last step, so preflight measures nothing
    skipped = r"^\s+ok [\d.]+ s, skipped: checkpoint/tiny@\S+ is at train.steps=10: the resumed run trains no step$"
    assert re.search(skipped, again, re.M) and len(list(store.ls("preflight"))) == 1


def test_unreachable_store_fails_before_any_stage(in_tmp, capfd, monkeypatch):
    from tests.conftest import free_port

    monkeypatch.setenv("MINIO_ENDPOINT", f"127.0.0.1:{free_port()}")
    assert main(["run", *FAST, "store=minio", "store.timeout_s=1"]) == 2
    captured = capfd.readouterr()
    assert "Executing task" not in captured.out
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and "unreachable" in err[0] and "Traceback" not in captured.err


def test_bad_override_and_unknown_subcommand_are_one_line(in_tmp, capfd):
    assert main(["run", "train.nonsense=1"]) == 2
    assert main(["launch"]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "train.nonsense" in err[0] and "unknown command 'launch'" in err[1]


def test_a_group_edited_as_the_ui_sends_it_fails_in_the_stage_naming_the_key(in_tmp, capfd):
    """Clone run in the Kubeflow UI: the train group's JSON edited to a value compose would
    refuse. kfp.local runs the real pipeline; the first stage that receives `train` refuses it."""
    import kfp.local

    from components.config import compose, group_dicts
    from pipelines.pretrain import build_pipeline

    groups = group_dicts(compose(FAST))
    groups["train"]["warmup_steps"] = groups["train"]["steps"] + 5
    groups["store"] = {**groups["store"], "root": str(in_tmp / "artifacts"), "cache_dir": str(in_tmp / ".cache")}
    kfp.local.init(runner=kfp.local.SubprocessRunner(use_venv=False), pipeline_root=str(in_tmp / "kfp"))
    with pytest.raises(RuntimeError):
        build_pipeline(compose(FAST))(**groups)
    out = "\n".join(capfd.readouterr())
    stage_lines = [ln for ln in out.splitlines() if "ConfigError: invalid config: train.warmup_steps" in ln]
    assert stage_lines and "must be >= 0 and < train.steps=10" in stage_lines[-1]
    assert executed(out) == ["tokenize-plan", "tokenize-shard", "tokenize-merge", "preflight"]  # train never launched
    assert not (in_tmp / "runs").exists()


@pytest.mark.chaos_slow  # 2-3.5 min: in `make chaos`, out of `make test`'s 30 minutes
def test_an_optuna_sweep_runs_its_trials_and_reports_the_best_read_from_the_store(in_tmp, capfd):
    """Issue 25, acceptance 3: Hydra's Optuna sweeper samples four learning rates in the interval;
    each trial is a whole run whose objective is its eval artifact's val loss in the store, and
    sweep.md / sweep.html name the best."""
    from omegaconf import OmegaConf

    from components.config import compose
    from components.store import open_store

    sweep_args = ["hydra/sweeper=optuna", "train.lr=interval(1e-4,1e-2)", "hydra.sweeper.n_trials=4"]
    assert main(["run", "-m", *sweep_args, *TOY]) == 0
    out = capfd.readouterr().out
    (sweep,) = (in_tmp / "multirun").glob("*/*")
    trials = sorted(p for p in sweep.iterdir() if p.is_dir())
    assert [p.name for p in trials] == ["0", "1", "2", "3"]
    lrs = []
    for folder in trials:
        (lr,) = [o for o in OmegaConf.load(folder / ".hydra" / "overrides.yaml") if o.startswith("train.lr=")]
        lrs.append(float(lr.split("=", 1)[1]))
    assert len(set(lrs)) == 4 and all(1e-4 <= lr <= 1e-2 for lr in lrs)
    # each trial's objective, read here from the store: the eval of the model trained at that lr
    store = open_store(OmegaConf.to_object(compose(TOY).store))
    models = {m.metadata["train"]["lr"]: str(m.ref) for m in store.ls("model")}
    val = {
        lr: next(e.metadata["metrics"]["val_loss"] for e in store.ls("eval") if models[lr] in e.parents) for lr in lrs
    }
    best_lr = min(val, key=val.get)
    md = (sweep / "sweep.md").read_text()
    for lr, loss in val.items():
        assert re.search(rf"\| train\.lr={re.escape(repr(lr))}\S* .*\| {loss:.6g} \|", md), (lr, loss, md)
    best = re.search(r"^best: trial (\d), val_loss (\S+): (.*)$", md, re.M)
    assert best and float(best[2]) == pytest.approx(val[best_lr], rel=1e-5) and f"train.lr={best_lr!r}" in best[3]
    assert OmegaConf.load(sweep / "optimization_results.yaml").best_value == pytest.approx(val[best_lr])
    assert "sweep.md, sweep.html" in out
    html = (sweep / "sweep.html").read_text()
    assert html.count("data:image/png;base64,") == 2  # objective per trial, parameter importance


def test_a_search_space_the_rules_refuse_fails_before_any_trial(in_tmp, capfd):
    """train.min_lr <= train.lr is a rule: an interval reaching below min_lr is one line, exit 2, no run."""
    assert main(["run", "-m", "hydra/sweeper=optuna", "train.lr=interval(1e-6,1e-2)", *TOY]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.lr=interval(1e-6,1e-2)" in err[0] and "train.min_lr" in err[0], err
    assert not list(in_tmp.glob("multirun/*/*/0"))


@pytest.mark.chaos_slow  # 62 s, two whole runs: in `make chaos`; the end-to-end run keeps a rerun's reuse
def test_a_rerun_recomputes_what_the_store_lost_whatever_the_cache_holds(in_tmp, capfd):
    """kfp.local's cache keeps the shard task's output (a ref into the store) across runs; the
    store does not always keep the object. After `artifacts rm` of the dataset's shard with its
    dependants (the dataset, the checkpoints, the model), a rerun of the same config tokenizes
    the lost shard again and trains end to end, the dataset version unchanged. (A wiped store,
    the plan gone too: tests/tokenize/test_tokenize.py.) The rerun reuses the first run's
    measurements of the fleet; a node quarantined before both is left out, and said so."""
    import socket

    from components import fleet
    from components.config import defaults
    from components.store import open_store

    def store():
        return open_store(defaults("store", root=str(in_tmp / "artifacts"), cache_dir=str(in_tmp / ".cache")))

    node1 = f"{socket.gethostname()}-node1"  # a finding against node 1 before the runs: it is left out
    fleet.quarantine(store(), node1, "test", "a finding of the operator's", 3600.0)
    assert main(["run", *FAST]) == 0
    said = capfd.readouterr().out  # the train line names the nodes it trained on and the one left out
    assert re.search(
        rf"; on \S+-node0, \S+-node2; left out {node1}: quarantined: a finding of the operator's$", said, re.M
    )
    (dataset,) = [str(m.ref) for m in store().ls("dataset")]
    (shard,) = [str(m.ref) for m in store().ls("shard")]
    assert main(["artifacts", "rm", shard, "--with-dependants"]) == 0
    assert not list(store().ls("dataset")) and not list(store().ls("model"))
    capfd.readouterr()
    assert main(["run", *FAST]) == 0
    assert [str(m.ref) for m in store().ls("dataset")] == [dataset] and len(list(store().ls("model"))) == 1
    # both runs executed the shard task: the second was not answered by the cache with a ref to nothing
    assert executed(run_logs(in_tmp / "runs")).count("tokenize-shard") == 2
    # issue 43, acceptance 1: the second run (same fleet, same dataset, minutes later) reuses the
    # first's measurements: one stored version, no second preflight job, the status line says so
    (measured,) = [m for m in store().ls("preflight")]
    reports = [m.parents for m in store().ls("preflight-report")]
    assert reports == [[str(measured.ref)], [str(measured.ref)]]  # the first run's and the second's
    assert len(list((in_tmp / "runs" / "preflight").iterdir())) == 1  # only the first run launched workers
    reused = r"^\s+ok [\d.]+ s, measurements reused \(\d+ min old\), 2/2 nodes healthy"
    assert re.search(reused, capfd.readouterr().out, re.M)


def test_data_that_cannot_fill_a_step_fails_in_preflight_which_kfp_never_retries(in_tmp, capfd):
    """Issue 42, acceptance 9: a deterministic failure (the data's fit) fails in the preflight
    task, which is compiled without a retry policy (test_cluster.py holds the IR to that), before
    it benchmarks anything; train, which KFP retries, never starts."""
    assert main(["run", *FAST, "train.micro_batch_size=4096"]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "stage preflight failed: DataFitError: " in err[0], err
    assert "= 8192 blocks per step, but the train split has only 3189 blocks" in err[0], err[0]
    ran = executed(run_logs(in_tmp / "runs"))
    assert "preflight" in ran and "train" not in ran, ran
    assert not (in_tmp / "runs" / "preflight").exists()  # no benchmark job was launched


@pytest.mark.parametrize(
    ("overrides", "nearest"),
    [
        (["model=70b"], r"no layout up to 32 nodes fits: a smaller model or a shorter data\.seq_len"),
        (["model=7b"], r"nearest layout that fits: train\.parallelism=fsdp cluster\.nodes=\d+"),
    ],
)
def test_a_model_that_cannot_fit_is_refused_before_any_task_runs(in_tmp, overrides, nearest):
    """`liftoff run` plans every job before the first task: a model that cannot fit this host is
    one line naming the plan, the nearest layout that fits and `liftoff plan`, in seconds; no
    tokenize task ran, nothing is in the store, no run folder was made."""
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    pinned = "preflight.device_memory_gb=24"  # the verdict must not depend on the test machine's RAM
    cmd = [sys.executable, "-m", "pipelines.cli", "run", *FAST, *overrides, pinned]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=in_tmp, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    line = proc.stderr.strip()
    assert re.fullmatch(
        r"liftoff run: the plan does not fit by [\d.]+ GiB: [\d.]+ GiB per device \(preflight\.memory_headroom=0\.1\)"
        rf" > 22\.4 GiB \(this host\); {nearest}; `liftoff plan` with these overrides says more",
        line,
    ), line
    assert not (in_tmp / "local_outputs").exists() and not (in_tmp / "artifacts").exists()
    assert not (in_tmp / "runs").exists()
