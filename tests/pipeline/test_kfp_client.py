"""compile, upload and submit, against the compiled YAML and a loopback KFP REST server."""

from __future__ import annotations

import json

import pytest
import yaml

from pipelines.cli import main
from tests.conftest import S3_ACCESS_KEY, S3_SECRET_KEY
from tests.pipeline.fake_kfp import FakeKfp

GROUPS = ["data", "tokenizer", "model", "train", "preflight", "eval", "cluster", "store"]


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MINIO_ACCESS_KEY", S3_ACCESS_KEY)
    monkeypatch.setenv("MINIO_SECRET_KEY", S3_SECRET_KEY)
    return tmp_path


def test_compile_has_one_dict_per_group_and_no_secrets(in_tmp, capsys):
    from kfp.components import load_component_from_file

    assert main(["compile", "store=minio", "model=1b"]) == 0
    path = in_tmp / "build" / "pretrain.yaml"
    component = load_component_from_file(str(path))
    assert component.name == "liftoff-pretrain"
    text = path.read_text()
    assert S3_SECRET_KEY not in text and S3_ACCESS_KEY not in text
    docs = list(yaml.safe_load_all(text))
    spec = docs[0]
    params = spec["root"]["inputDefinitions"]["parameters"]
    assert sorted(params) == sorted(GROUPS) and all(p["parameterType"] == "STRUCT" for p in params.values())
    defaults = {g: params[g]["defaultValue"] for g in GROUPS}
    assert defaults["model"]["hidden_size"] == 2048 and defaults["store"]["backend"] == "minio"
    assert len(json.dumps(defaults)) < 10_000
    tasks = spec["root"]["dag"]["tasks"]
    assert tasks["preflight"]["cachingOptions"] == {}  # caching off: the key is absent
    assert tasks["train"]["cachingOptions"] == {"enableCache": True}
    # the local scheduler: no task retries (kfp.local would rerun a failing task after a backoff)
    assert not any("retryPolicy" in t for t in tasks.values())
    assert set(tasks) == {"tokenize-plan", "for-loop-1", "tokenize-merge", "preflight", "train", "validate", "evaluate"}
    loop = tasks["for-loop-1"]
    assert loop["parameterIterator"]["items"]["inputParameter"] == "pipelinechannel--tokenize-plan-Output"
    assert loop["iteratorPolicy"]["parallelismLimit"] == 4  # data.parallelism, compiled in
    assert tasks["train"]["inputs"]["parameters"].keys() == {"data", "model", "train", "cluster", "store"}
    platform = docs[1]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    for executor in platform.values():
        names = {s["secretName"] for s in executor["secretAsEnv"]}
        assert names == {"liftoff-minio"}
        assert executor["emptyDirMounts"][0]["mountPath"] == "/dev/shm"


def test_upload_then_upload_again_is_a_noop(in_tmp, capsys):
    with FakeKfp() as kfp:
        assert main(["upload", f"kfp.host={kfp.url}"]) == 0
        first = capsys.readouterr().out
        assert "uploaded pipeline liftoff-pretrain version" in first
        uploads = [r for r in kfp.requests if r["method"] == "POST"]
        assert uploads[0]["path"] == "/apis/v2beta1/pipelines/upload"
        assert b"liftoff-pretrain" in uploads[0]["body"] and b"pipelineInfo" in uploads[0]["body"]
        assert uploads[1]["path"] == "/apis/v2beta1/pipelines/upload_version"
        posts = len(uploads)
        assert main(["upload", f"kfp.host={kfp.url}"]) == 0
        assert "already uploaded; nothing to do" in capsys.readouterr().out
        assert len([r for r in kfp.requests if r["method"] == "POST"]) == posts
        assert main(["upload", f"kfp.host={kfp.url}", "train.lr=0.01"]) == 0  # new config: new version
        assert "uploaded" in capsys.readouterr().out and len(kfp.versions["p1"]) == 3


def test_upload_with_a_namespace_makes_the_profiles_own_pipeline(in_tmp, capsys):
    """Multi-user KFP (>= 2.16) authorizes a shared pipeline against its system namespace, which
    a profile's account may not write: with kfp.namespace the pipeline is uploaded into, and
    looked up in, that namespace."""
    with FakeKfp() as kfp:
        assert main(["upload", f"kfp.host={kfp.url}", "kfp.namespace=team-a"]) == 0
    upload = next(r for r in kfp.requests if r["path"] == "/apis/v2beta1/pipelines/upload")
    assert upload["query"].get("namespace") == ["team-a"]
    lookups = [r for r in kfp.requests if r["method"] == "GET" and r["path"] == "/apis/v2beta1/pipelines"]
    assert lookups and all(r["query"].get("namespace") == ["team-a"] for r in lookups)


def test_submit_sweep_makes_one_run_per_job_in_one_experiment(in_tmp, capsys):
    with FakeKfp() as kfp:
        assert main(["submit", "-m", f"kfp.host={kfp.url}", "train.lr=0.001,0.003", "kfp.service_account=sa"]) == 0
        assert len(kfp.runs) == 2 and len(kfp.experiments) == 1
        experiment = next(iter(kfp.experiments.values()))
        assert experiment["display_name"].startswith("liftoff-")
        lrs = sorted(r["runtime_config"]["parameters"]["train"]["lr"] for r in kfp.runs)
        assert lrs == [0.001, 0.003]
        for run in kfp.runs:
            assert run["experiment_id"] == experiment["experiment_id"] and run["service_account"] == "sa"
            assert set(run["runtime_config"]["parameters"]) == set(GROUPS)
            assert S3_SECRET_KEY not in json.dumps(run)
            assert run["pipeline_spec"]["pipeline_spec"]["pipelineInfo"]["name"] == "liftoff-pretrain"
            assert "liftoff-minio" in json.dumps(run["pipeline_spec"]["platform_spec"])


def test_submit_keeps_the_compiled_caching_of_each_task(in_tmp):
    """Issue 42, acceptance 6: the run body `submit` sends keeps preflight's and the tokenize
    plan's caching off (a stale verdict or plan must never be reused) and train's on; the kfp
    client's enable_caching=True would rewrite every task's cachingOptions to enableCache=True."""
    with FakeKfp() as kfp:
        assert main(["submit", f"kfp.host={kfp.url}"]) == 0
    (sent,) = [r for r in kfp.requests if r["method"] == "POST" and r["path"] == "/apis/v2beta1/runs"]
    tasks = json.loads(sent["body"])["pipeline_spec"]["pipeline_spec"]["root"]["dag"]["tasks"]
    assert not tasks["preflight"].get("cachingOptions", {}).get("enableCache")
    assert not tasks["tokenize-plan"].get("cachingOptions", {}).get("enableCache")
    assert tasks["train"]["cachingOptions"] == {"enableCache": True}


def test_submit_without_a_host_is_one_clear_line(in_tmp, capsys, monkeypatch):
    monkeypatch.delenv("KF_PIPELINES_ENDPOINT", raising=False)
    assert main(["submit"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "liftoff submit: no Kubeflow Pipelines endpoint: set kfp.host=URL or $KF_PIPELINES_ENDPOINT"


def test_unreachable_kfp_host_is_one_clear_line(in_tmp, capsys):
    from tests.conftest import free_port

    assert main(["upload", f"kfp.host=http://127.0.0.1:{free_port()}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Kubeflow Pipelines at http://127.0.0.1:" in err
    assert "Traceback" not in err


def test_every_edge_is_an_artifact_and_the_cluster_settings_come_from_config(in_tmp):
    """The UI graph shows the whole lineage: preflight's verdict feeds train, validate's model
    feeds evaluate; image, pull policy, Secret and pipeline name are the composed config's."""
    overrides = [
        "cluster=kubernetes",
        "cluster.image=registry.example.com/liftoff:0123456789",
        "cluster.image_pull_policy=IfNotPresent",
        "store.secret_name=team-minio",
        "kfp.pipeline_name=team-pretrain",
    ]
    assert main(["compile", *overrides]) == 0
    docs = list(yaml.safe_load_all((in_tmp / "build" / "pretrain.yaml").read_text()))
    spec = docs[0]
    assert spec["pipelineInfo"]["name"] == "team-pretrain"
    tasks = spec["root"]["dag"]["tasks"]
    train_in = tasks["train"]["inputs"]["artifacts"]
    assert train_in["preflight_verdict"]["taskOutputArtifact"] == {
        "producerTask": "preflight",
        "outputArtifactKey": "verdict",
    }
    eval_in = tasks["evaluate"]["inputs"]
    assert "parameters" not in eval_in or "model_ref" not in eval_in["parameters"]
    assert eval_in["artifacts"]["validated_model"]["taskOutputArtifact"]["producerTask"] == "validate"
    assert (
        spec["components"]["comp-evaluate"]["inputDefinitions"]["artifacts"]["validated_model"]["artifactType"][
            "schemaTitle"
        ]
        == "system.Model"
    )
    images = {e["container"]["image"] for e in spec["deploymentSpec"]["executors"].values()}
    assert images == {"registry.example.com/liftoff:0123456789"}
    platform = docs[1]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    assert {e["imagePullPolicy"] for e in platform.values()} == {"IfNotPresent"}
    assert {s["secretName"] for e in platform.values() for s in e["secretAsEnv"]} == {"team-minio"}


def test_submit_authenticates_with_a_token_and_wait_follows_the_run(in_tmp, monkeypatch, capsys):
    """Finding 10: behind Dex / oauth2-proxy every call carries credentials; `submit --wait`
    prints the run's UI URL, follows it and exits non-zero when it fails (for CI)."""
    monkeypatch.setenv("KF_PIPELINES_TOKEN", "sentinel-bearer-token")
    with FakeKfp() as kfp:
        assert main(["submit", "--wait", f"kfp.host={kfp.url}", "kfp.namespace=team-a"]) == 0
        out = capsys.readouterr().out
        assert f"{kfp.url}/#/runs/details/r1" in out and "run r1: SUCCEEDED" in out
        assert kfp.requests and all(
            r["headers"].get("authorization") == "Bearer sentinel-bearer-token" for r in kfp.requests
        )
        assert kfp.runs[0]["experiment_id"] and any(r["path"] == "/apis/v2beta1/runs/r1" for r in kfp.requests)
        kfp.final_state = "FAILED"
        assert main(["submit", "--wait", f"kfp.host={kfp.url}"]) == 1
        assert "run r2: FAILED" in capsys.readouterr().out


def test_submit_with_a_session_cookie(in_tmp, monkeypatch):
    monkeypatch.delenv("KF_PIPELINES_TOKEN", raising=False)
    monkeypatch.setenv("KF_PIPELINES_COOKIE", "authservice_session=sentinel-session")
    with FakeKfp() as kfp:
        assert main(["submit", f"kfp.host={kfp.url}"]) == 0
        assert all("authservice_session=sentinel-session" in r["headers"].get("cookie", "") for r in kfp.requests)


@pytest.mark.chaos_slow  # 2 min: in `make chaos`, out of `make test`'s 30 minutes
def test_an_optuna_sweep_on_kfp_scores_each_run_by_the_eval_it_put_in_the_store(in_tmp, capsys):
    """Issue 25 (Bayesian sweeps on the cluster): each trial is one KFP run in the sweep's
    experiment, followed to its end; its objective is the eval artifact that run's evaluate stage
    published (here: the stand-in runs the submitted parameters through kfp.local)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from omegaconf import OmegaConf

    from components.config import compose
    from components.store import open_store
    from tests.helpers import TOY

    def execute(run: dict) -> None:
        params = in_tmp / f"run-{run['run_id']}.json"
        params.write_text(json.dumps(run["runtime_config"]["parameters"]))
        root = str(Path(__file__).resolve().parents[2])
        command = [sys.executable, "-m", "tests.pipeline.cluster_stand_in", str(params)]
        env = {**os.environ, "PYTHONPATH": root}
        subprocess.run(command, check=True, capture_output=True, cwd=in_tmp, timeout=300, env=env)

    sweep = ["hydra/sweeper=optuna", "train.lr=interval(1e-3,1e-2)", "hydra.sweeper.n_trials=2"]
    with FakeKfp() as kfp:
        kfp.executor = execute
        assert main(["submit", "-m", *sweep, *TOY, f"kfp.host={kfp.url}"]) == 0
    assert len(kfp.runs) == 2 and len(kfp.experiments) == 1
    lrs = [r["runtime_config"]["parameters"]["train"]["lr"] for r in kfp.runs]
    store = open_store(OmegaConf.to_object(compose(TOY).store))
    models = {m.metadata["train"]["lr"]: str(m.ref) for m in store.ls("model")}
    val = {
        lr: next(e.metadata["metrics"]["val_loss"] for e in store.ls("eval") if models[lr] in e.parents) for lr in lrs
    }
    (md,) = in_tmp.glob("multirun/*/*/sweep.md")
    text = md.read_text()
    for lr in lrs:
        assert f"| train.lr={lr!r} | {val[lr]:.6g} |" in text, (lr, text)
    best = min(val, key=val.get)
    assert f"val_loss {val[best]:.6g}: train.lr={best!r}" in text
