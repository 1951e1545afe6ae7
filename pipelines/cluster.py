"""The pipeline on a Kubeflow cluster: compile, upload and submit (`liftoff compile | upload | submit`)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from omegaconf import DictConfig

from components.config import group_dicts
from components.store import code_version

BUILD = Path("build")


class KfpError(RuntimeError):
    pass


def compile_pipeline(cfg: DictConfig, path: Path) -> Path:
    """IR YAML with the composed config as the defaults of the per-group dict parameters."""
    from kfp import compiler

    from pipelines.pretrain import build_pipeline

    path.parent.mkdir(parents=True, exist_ok=True)
    compiler.Compiler().compile(
        build_pipeline(cfg),
        str(path),
        pipeline_name=cfg.kfp.pipeline_name,
        pipeline_parameters=group_dicts(cfg),
    )
    return path


def short_commit(version: str) -> str:
    """`0123456789` or `0123456789-dirty` from a full code version."""
    commit, _, dirty = version.partition("-")
    return commit[:10] + (f"-{dirty}" if dirty else "")


def config_hash(cfg: DictConfig) -> str:
    return hashlib.sha256(json.dumps(group_dicts(cfg), sort_keys=True).encode()).hexdigest()[:10]


def client(cfg: DictConfig):
    import kfp

    host = cfg.kfp.host or os.environ.get("KF_PIPELINES_ENDPOINT")
    if not host:
        raise KfpError("no Kubeflow Pipelines endpoint: set kfp.host=URL or $KF_PIPELINES_ENDPOINT")
    return _call(lambda: kfp.Client(host=host, namespace=cfg.kfp.namespace or "kubeflow"), cfg)


def upload(cfg: DictConfig) -> str:
    """Upload the pipeline, or a new version named <git commit>-<config hash>; a no-op when it exists."""
    kfp_client = client(cfg)
    version = f"{short_commit(code_version())}-{config_hash(cfg)}"
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
