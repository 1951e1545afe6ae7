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


def refuse_unrunnable(cfg: DictConfig) -> None:
    """A cluster run that cannot work, refused before anything is compiled or sent, in one
    line: a local store on Kubernetes (every pod would write its own disk, and no stage would
    see another's artifacts), one process for several GPUs (the tiny preset's procs_per_node=1
    beside cluster.gpu=8: 7 idle), a plan that does not fit the device, or data that cannot
    fill one step (the shipped corpus under a cluster preset's global batch)."""
    from omegaconf import OmegaConf

    from components.config import CONF_DIR, ConfigError, Scheduler, StoreBackend
    from components.preflight.plan_config import plan_refusal

    typed = OmegaConf.to_object(cfg)
    c, problems = typed.cluster, []
    if c.scheduler == Scheduler.kubernetes:
        if typed.store.backend == StoreBackend.local:
            problems.append(
                "store.backend=local with cluster.scheduler=kubernetes: each pod would keep its own store "
                "and no stage would see another's artifacts; use store=minio (any S3 endpoint)"
            )
        if c.gpu > 0 and c.procs_per_node != c.gpu:
            problems.append(
                f"cluster.procs_per_node={c.procs_per_node} with cluster.gpu={c.gpu}: training runs one "
                f"process per GPU; set cluster.procs_per_node={c.gpu} (or a cluster preset: experiment=h200-7b)"
            )
    # on Kubernetes with no device known (gpu_type null, no device_memory_gb) the plan would be
    # judged against this workstation's RAM: preflight judges it against the measured device
    judged = c.scheduler != Scheduler.kubernetes or c.gpu_type or typed.preflight.device_memory_gb
    if judged and (refusal := plan_refusal(typed)):
        problems.append(refusal)
    if refusal := data_fit_refusal(typed.data, typed.train, c, CONF_DIR.parent):
        problems.append(refusal)
    if problems:
        raise ConfigError("; ".join(problems))


def source_bytes(paths: list[str], root: Path) -> int | None:
    """The bytes of `data.paths` when every entry is a local file or directory (relative to the
    current directory, else to `root`, the checkout whose files the image carries); None when
    one is not measurable from here (an s3:// prefix, a path this machine does not have)."""
    from components.tokenize.sources import local_paths

    total = 0
    for raw in paths:
        if "://" in raw:
            return None
        p = Path(raw).expanduser()
        p = p if p.is_absolute() or p.exists() else root / p
        if not p.exists():
            return None
        total += sum(f.stat().st_size for f in local_paths(p))
    return total


def mixture_fit_refusal(data, samples: int, root: Path) -> str | None:
    """One line when a capped source of a mixture cannot feed its share of the run, judged from
    its bytes before tokenize (at most one block per `seq_len + 1` bytes): weight x samples draws
    against data.sources.<name>.max_epochs passes. Uncapped sources repeat; a source's real
    block count is checked again before training (components.mixture.check_mixture_feeds)."""
    sizes = {}
    for name in data.source_names:
        src = data.source(name)
        sizes[name] = None if (src.hub_name and not src.paths) else source_bytes(list(src.paths), root)
    if any(v is None for v in sizes.values()) and not data.mixture:
        return None  # the default weights are the sources' sizes: unknown here
    raw = data.mixture or {n: float(s) for n, s in sizes.items()}
    total = sum(raw.values())
    for name, size in sizes.items():
        cap, weight = data.sources[name].max_epochs, raw.get(name, 0.0) / total
        if cap is None or size is None or weight == 0:
            continue
        most = int(cap * (size // (data.seq_len + 1)))
        need = int(weight * samples)
        if need > most:
            return (
                f"data.sources.{name}.max_epochs={cap:g}: the run draws about {need} samples of {name} (weight "
                f"{weight:.3g} x {samples}), but its {size} bytes make at most {most} in {cap:g} pass(es); lower its "
                "weight, raise max_epochs or train fewer steps"
            )
    return None


def data_fit_refusal(data, train, cluster, root: Path) -> str | None:
    """One line when the data cannot fill one optimizer step, judged before tokenize from the
    source bytes: no tokenizer makes more than one token per byte (a byte-level BPE makes at
    most one; JSON's quoting and keys outweigh the EOS per document), so `bytes // (seq_len + 1)`
    bounds the train split's blocks from above. None when it may fit or cannot be measured
    here (a hub dataset, s3:// sources: train's check_inputs judges the tokenized dataset)."""
    from components.prelaunch import blocks_per_step

    world, per_step = blocks_per_step(train, cluster)
    block = data.seq_len + 1
    if data.sources:
        return mixture_fit_refusal(data, train.steps * per_step, root)
    if data.hub_name and not data.paths:
        return None
    size = source_bytes(list(data.paths), root)
    if size is None or size // block >= per_step:
        return None
    return (
        f"the data cannot fill one step: train.micro_batch_size={train.micro_batch_size} x "
        f"train.grad_accum_steps={train.grad_accum_steps} x data-parallel world {world} = {per_step} blocks of "
        f"{block} tokens per step, but data.paths ({size} bytes) gives at most {size // block} (one token per "
        f"byte at most); name more data (data.paths=[s3://<bucket>/<prefix>], or data=hub) or a smaller batch"
    )


def refuse_local_render(cfg: DictConfig) -> None:
    """`render` shows the Kubernetes objects of a cluster run; a config for this machine
    (cluster.scheduler=local_cwd, the default) creates none, so it is refused in one line that
    names a cluster preset (and `compile`, which writes the pipeline of any config)."""
    from components.config import ConfigError

    scheduler = getattr(cfg.cluster.scheduler, "value", cfg.cluster.scheduler)
    if scheduler != "kubernetes":
        raise ConfigError(
            f"render shows the Kubernetes objects of a cluster run, and cluster.scheduler={scheduler} (this "
            "machine) creates none: render a cluster preset on data that fills its steps (liftoff render "
            "experiment=h200-7b data=hub data.hub_revision=<commit>), or use `liftoff compile` for the pipeline alone"
        )


def render(cfg: DictConfig, out: Path = BUILD) -> list[Path]:
    """What a cluster run would create, for review (like `helm template`) and schema tests:
    the compiled pipeline and TorchX's own Kubernetes dry run of the train and preflight jobs."""
    import yaml
    from omegaconf import OmegaConf

    from components import k8s

    refuse_local_render(cfg)
    refuse_unrunnable(cfg)
    typed = OmegaConf.to_object(cfg)
    namespace = typed.cluster.namespace or "default"
    jobs = replica_jobs(typed, namespace)
    written = [compile_pipeline(cfg, out / "pretrain.yaml")]
    (out / "jobs").mkdir(parents=True, exist_ok=True)
    for stage, job in jobs.items():
        path = out / "jobs" / f"{stage}.yaml"
        path.write_text(yaml.safe_dump(job, sort_keys=False))
        written.append(path)
    if typed.train.metrics_port:  # the monitoring namespace let in past the policy Volcano adds per job
        path = out / "networkpolicy.yaml"
        path.write_text(yaml.safe_dump(k8s.metrics_policy(namespace, typed.train.metrics_port), sort_keys=False))
        written.append(path)
    return written


def replica_jobs(typed, namespace: str) -> dict[str, dict]:
    """The train and preflight Volcano jobs of a typed cluster config, as the API server would
    receive them: what `render` writes and what `liftoff doctor` holds the cluster to. The
    dataset version is known only once tokenize has run; the jobs name it `@RENDERED`."""
    from components import k8s
    from components.launcher import kubernetes_job
    from components.preflight.stage import preflight_launch
    from components.train.stage import train_launch

    dataset = f"dataset/{typed.data.name}@RENDERED"
    from components.mixture import max_epochs

    # a mixture's weights as configured (data.mixture {}: by the sources' sizes, known after tokenize)
    weights = typed.data.weights({}) if typed.data.sources and typed.data.mixture else {}
    _, _, train = train_launch(
        dataset, typed.model, typed.train, typed.cluster, typed.store, cache_gb=typed.data.cache_gb,
        mixture=weights, max_epochs=max_epochs(typed.data),
    )  # fmt: skip
    preflight = preflight_launch(dataset, typed.model, typed.train, typed.cluster, typed.preflight, typed.store)
    return {
        stage: k8s.as_plain(kubernetes_job(launch, {"LIFTOFF_ATTEMPT": "0"}, namespace=namespace).request.resource)
        for stage, launch in (("train", train), ("preflight", preflight))
    }


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
    namespace = cfg.kfp.namespace or "kubeflow"
    return _call(lambda: kfp.Client(host=host, namespace=namespace, **credentials()), cfg)


def credentials() -> dict:
    """How liftoff authenticates to Kubeflow Pipelines, first found wins: $KF_PIPELINES_TOKEN
    (a bearer token: `kubectl create token`, an OIDC login), $KF_PIPELINES_COOKIE (the
    `authservice_session=...` cookie of a browser session behind Dex / oauth2-proxy), or, in
    a pod, the projected service-account token KFP mounts (ServiceAccountTokenVolumeCredentials)."""
    if token := os.environ.get("KF_PIPELINES_TOKEN"):
        return {"existing_token": token}
    if cookie := os.environ.get("KF_PIPELINES_COOKIE"):
        return {"cookies": cookie}
    token_file = Path(os.environ.get("KF_PIPELINES_SA_TOKEN_PATH", "/var/run/secrets/kubeflow/pipelines/token"))
    if token_file.is_file():
        from kfp.client import ServiceAccountTokenVolumeCredentials

        return {"credentials": ServiceAccountTokenVolumeCredentials(str(token_file))}
    return {}


def run_url(cfg: DictConfig, run_id: str) -> str:
    host = (cfg.kfp.host or os.environ.get("KF_PIPELINES_ENDPOINT", "")).rstrip("/")
    return f"{host}/#/runs/details/{run_id}"


def wait(cfg: DictConfig, run_id: str, timeout_s: float) -> str:
    """Follow a run to its end (for CI); its final state."""
    import datetime

    run = _call(lambda: client(cfg).wait_for_run_completion(run_id, datetime.timedelta(seconds=timeout_s)), cfg)
    return str(run.state)


def checked_backend(cfg: DictConfig, kfp_client, package: Path) -> None:
    """Refuse a backend older than the compiled pipeline needs (pipelines/kfp_features.py), in
    one line naming the feature; warn when the backend does not report its version."""
    import sys

    from pipelines import kfp_features

    host = cfg.kfp.host or os.environ.get("KF_PIPELINES_ENDPOINT")
    version = _call(lambda: kfp_features.backend_version(kfp_client), cfg)
    spec, platform = kfp_features.read_ir(package)
    try:
        warning = kfp_features.check_backend(version, spec, platform, host)
    except kfp_features.BackendTooOld as e:
        raise KfpError(str(e)) from None
    if warning:
        print(f"warning: {warning}", file=sys.stderr)


def refuse_before_kfp(cfg: DictConfig, skip_doctor: bool) -> None:
    """What upload and submit refuse before their first call to KFP: a config that cannot run,
    then (unless skipped) the cluster or store of a cluster config (cluster.scheduler=kubernetes)
    the doctor finds unfit (pipelines/doctor.py). A local_cwd config launches nothing on the
    cluster: its replicas run inside the KFP task's own pod."""
    from pipelines.doctor import refuse_unhealthy

    refuse_unrunnable(cfg)
    if not skip_doctor and getattr(cfg.cluster.scheduler, "value", cfg.cluster.scheduler) == "kubernetes":
        refuse_unhealthy(cfg)


def upload(cfg: DictConfig, skip_doctor: bool = False) -> str:
    """Upload the pipeline, or a new version named <git commit>-<config hash>; a no-op when it exists."""
    refuse_before_kfp(cfg, skip_doctor)
    kfp_client = client(cfg)
    version = f"{short_commit(code_version())}-{config_hash(cfg)}"
    package = compile_pipeline(cfg, BUILD / "pretrain.yaml")
    checked_backend(cfg, kfp_client, package)
    name, namespace = cfg.kfp.pipeline_name, cfg.kfp.namespace
    # with kfp.namespace the pipeline is the profile's own: multi-user KFP (>= 2.16) authorizes a
    # shared pipeline against its system namespace, which a profile's account may not write
    pipeline_id = _call(lambda: _pipeline_id(kfp_client, name, namespace), cfg)
    if pipeline_id is None:
        _call(
            lambda: kfp_client.upload_pipeline(
                str(package), pipeline_name=name, description="liftoff pretraining DAG", namespace=namespace
            ),
            cfg,
        )
        pipeline_id = _call(lambda: _pipeline_id(kfp_client, name, namespace), cfg)
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


def _pipeline_id(kfp_client, name: str, namespace: str | None) -> str | None:
    """The id of the pipeline named `name` (shared, or the namespace's own)."""
    if namespace is None:
        return kfp_client.get_pipeline_id(name)
    by_name = {"predicates": [{"operation": "EQUALS", "key": "display_name", "stringValue": name}]}
    found = kfp_client.list_pipelines(filter=json.dumps(by_name), namespace=namespace).pipelines or []
    return found[0].pipeline_id if found else None


DOCTOR_SKIPPED = " (doctor skipped)"  # ends the name of a run submitted with --skip-doctor


def submit(
    cfg: DictConfig, job_overrides: list[str], experiment: str, skip_doctor: bool = False, checked: bool = False
) -> str:
    """One run; `checked`: the caller has refused what refuse_before_kfp refuses already."""
    if not checked:
        refuse_before_kfp(cfg, skip_doctor)
    kfp_client = client(cfg)
    package = compile_pipeline(cfg, BUILD / f"pretrain-{config_hash(cfg)}.yaml")
    checked_backend(cfg, kfp_client, package)
    shown = [o for o in job_overrides if not o.lstrip("+~").startswith("kfp.")]
    suffix = DOCTOR_SKIPPED if skip_doctor else ""
    run_name = f"liftoff {' '.join(shown) or 'defaults'}"[: 120 - len(suffix)] + suffix
    run = _call(
        lambda: kfp_client.create_run_from_pipeline_package(
            str(package),
            arguments=group_dicts(cfg),
            run_name=run_name,
            experiment_name=experiment,
            namespace=cfg.kfp.namespace,
            service_account=cfg.kfp.service_account,
            enable_caching=None,  # each task as compiled: preflight and the tokenize plan never cached
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
