"""Running, compiling, uploading and submitting the pipeline: what the CLI's subcommands do."""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from components.config import group_dicts
from components.store import Ref, open_store

log = logging.getLogger(__name__)
BUILD = Path("build")
LOCAL_ROOT = Path("local_outputs")


class KfpError(RuntimeError):
    pass


def expand_sweep(overrides: list[str]) -> list[list[str]]:
    """Hydra's basic sweeper: the cartesian product of every `key=a,b,c` override."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    choices = []
    for o in OverridesParser.create().parse_overrides(overrides):
        if o.is_sweep_override():
            key = o.get_key_element()
            choices.append([f"{key}={v}" for v in o.sweep_string_iterator()])
        else:
            choices.append([o.input_line])
    return [list(job) for job in itertools.product(*choices)]


def compile_pipeline(cfg: DictConfig, path: Path) -> Path:
    """IR YAML with the composed config as the defaults of the per-group dict parameters."""
    from kfp import compiler

    from pipelines.pretrain import build_pipeline

    path.parent.mkdir(parents=True, exist_ok=True)
    compiler.Compiler().compile(
        build_pipeline(dict(cfg.cluster.node_selector)),
        str(path),
        pipeline_name=cfg.kfp.pipeline_name,
        pipeline_parameters=group_dicts(cfg),
    )
    return path


def run_local(cfg: DictConfig) -> dict:
    """The whole DAG through kfp.local (SubprocessRunner, current interpreter, caching on)."""
    import kfp.local

    from pipelines.pretrain import build_pipeline

    store = open_store(OmegaConf.to_object(cfg.store))  # an unreachable store fails here, before any stage
    root = LOCAL_ROOT.resolve()
    kfp.local.init(
        runner=kfp.local.SubprocessRunner(use_venv=False), pipeline_root=str(root / "kfp"), enable_caching=True
    )
    t0 = time.perf_counter()
    try:
        task = build_pipeline(dict(cfg.cluster.node_selector))(**group_dicts(cfg))
    except RuntimeError as e:
        raise KfpError(f"the pipeline failed: {str(e).splitlines()[0]} (the stage's log is above)") from None
    eval_ref = task.output if isinstance(task.output, str) else task.outputs["Output"]
    evaluation = store.manifest(Ref.parse(eval_ref))
    lineage = store.lineage(evaluation.ref)
    return {
        "eval": eval_ref,
        "metrics": evaluation.metadata["metrics"],
        "lineage": lineage,
        "seconds": time.perf_counter() - t0,
        "kfp_root": str(root / "kfp"),
    }


def flatten_lineage(node: dict) -> list[str]:
    out = [node["ref"]]
    for parent in node["parents"]:
        out += [r for r in flatten_lineage(parent) if r not in out]
    return out


def config_hash(cfg: DictConfig) -> str:
    return hashlib.sha256(json.dumps(group_dicts(cfg), sort_keys=True).encode()).hexdigest()[:10]


def git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short=10", "HEAD"], capture_output=True, text=True, check=True, timeout=5
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "nogit"


def client(cfg: DictConfig):
    import kfp

    host = cfg.kfp.host or os.environ.get("KF_PIPELINES_ENDPOINT")
    if not host:
        raise KfpError("no Kubeflow Pipelines endpoint: set kfp.host=URL or $KF_PIPELINES_ENDPOINT")
    return _call(lambda: kfp.Client(host=host, namespace=cfg.kfp.namespace or "kubeflow"), cfg)


def upload(cfg: DictConfig) -> str:
    """Upload the pipeline, or a new version named <git commit>-<config hash>; a no-op when it exists."""
    kfp_client = client(cfg)
    version = f"{git_commit()}-{config_hash(cfg)}"
    package = compile_pipeline(cfg, BUILD / "pretrain.yaml")
    name = cfg.kfp.pipeline_name
    pipeline_id = _call(lambda: kfp_client.get_pipeline_id(name), cfg)
    if pipeline_id is None:
        _call(
            lambda: kfp_client.upload_pipeline(str(package), pipeline_name=name, description="liftoff pretraining DAG"),
            cfg,
        )
        pipeline_id = _call(lambda: kfp_client.get_pipeline_id(name), cfg)
    existing = _call(lambda: kfp_client.list_pipeline_versions(pipeline_id, page_size=200), cfg)
    if any(v.display_name == version for v in existing.pipeline_versions or []):
        return f"pipeline {name} version {version} is already uploaded; nothing to do"
    _call(
        lambda: kfp_client.upload_pipeline_version(
            str(package), pipeline_version_name=version, pipeline_id=pipeline_id
        ),
        cfg,
    )
    return f"uploaded pipeline {name} version {version}"


def submit(cfg: DictConfig, job_overrides: list[str], experiment: str) -> str:
    kfp_client = client(cfg)
    package = compile_pipeline(cfg, BUILD / f"pretrain-{config_hash(cfg)}.yaml")
    shown = [o for o in job_overrides if not o.lstrip("+~").startswith("kfp.")]
    run_name = f"liftoff {' '.join(shown) or 'defaults'}"[:120]
    run = _call(
        lambda: kfp_client.create_run_from_pipeline_package(
            str(package),
            arguments=group_dicts(cfg),
            run_name=run_name,
            experiment_name=experiment,
            namespace=cfg.kfp.namespace,
            service_account=cfg.kfp.service_account,
            enable_caching=True,
        ),
        cfg,
    )
    return run.run_id


def sweep_name(overrides: list[str]) -> str:
    text = " ".join(sorted(overrides)) or "defaults"
    return f"liftoff-{hashlib.sha256(text.encode()).hexdigest()[:8]}"


def _call(fn, cfg: DictConfig):
    try:
        return fn()
    except Exception as e:  # kfp_server_api and urllib3 raise many types; name the host instead
        host = cfg.kfp.host or os.environ.get("KF_PIPELINES_ENDPOINT")
        reason = getattr(e, "reason", None) or str(e).splitlines()[0]
        raise KfpError(f"Kubeflow Pipelines at {host}: {type(e).__name__}: {reason}") from None


def print_summary(result: dict) -> None:
    print("\nartifacts:", file=sys.stdout)
    for ref in flatten_lineage(result["lineage"]):
        print(f"  {ref}")
    print("metrics:")
    for name, value in result["metrics"].items():
        print(f"  {name}: {value:.6g}")
    print(f"kfp.local outputs: {result['kfp_root']}  ({result['seconds']:.0f}s)")
