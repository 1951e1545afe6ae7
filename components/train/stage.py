"""The train stage: check the inputs, launch the workers with TorchX, publish the model."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

from components.config import ClusterConfig, ModelConfig, TrainConfig, as_plain_dict, drop_none
from components.launcher import Launch, run_app
from components.store import ArtifactStore, Manifest, Ref, sha256_file
from components.train.prelaunch import check_inputs

log = logging.getLogger(__name__)

# Train settings that do not change the weights' math up to the current step: a run differing
# only in these continues the same training (same checkpoints); anything else is a new
# training identity. `steps` is one of them: a longer run resumes where the shorter one ended
# (the cosine schedule is then stretched from there on to the new length). So is the world
# size: DCP reshards the checkpoint and the sample order does not depend on it.
NOT_IDENTITY = {
    "steps",
    "checkpoint_dir",
    "checkpoint_interval",
    "checkpoint_keep",
    "checkpoint_async",
    "resume",
    "run_dir",
    "log_interval",
    "max_bad_steps",
    "loss_spike_factor",
    "straggler_interval",
    "straggler_zscore",
    "watchdog_timeout_s",
    "peak_tflops",
    "compile",
    "activation_checkpointing",
    "ac_every_n_blocks",
}


@dataclass
class TrainResult:
    identity: str
    run_dir: Path
    model: Manifest
    final_loss: float
    checkpoint_version: str
    result: dict


def training_identity(dataset: str, model: ModelConfig, train: TrainConfig) -> str:
    math = {k: v for k, v in as_plain_dict(train).items() if k not in NOT_IDENTITY}
    ident = {"dataset": dataset, "model": drop_none(as_plain_dict(model)), "train": math}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def train_launch(
    dataset: str, model: ModelConfig, train: TrainConfig, cluster: ClusterConfig, store_cfg
) -> tuple[str, Path, Launch]:
    """(training identity, run directory, the TorchX job that trains it)."""
    identity = training_identity(dataset, model, train)
    run_dir = Path(train.run_dir).resolve() / identity
    spec = {
        "train": as_plain_dict(train),
        "model": drop_none(as_plain_dict(model)),
        "store": drop_none(as_plain_dict(store_cfg)),
        "dataset": dataset,
        "identity": identity,
        "run_dir": str(run_dir),
        "checkpoint_dir": str(
            Path(train.checkpoint_dir).resolve() / identity if train.checkpoint_dir else run_dir / "checkpoints"
        ),
    }
    return (
        identity,
        run_dir,
        Launch("components.train.worker", spec, cluster, f"train-{identity[:8]}", run_dir / "logs"),
    )


def run_train(
    dataset: str, model: ModelConfig, train: TrainConfig, cluster: ClusterConfig, store_cfg, store: ArtifactStore
) -> TrainResult:
    data_manifest = store.resolve(*_kind_name_version(dataset))
    data_dir = store.fetch(data_manifest)  # cached here, so local ranks find it verified
    check_inputs(data_dir, model, train, cluster, store)
    identity, run_dir, launch = train_launch(str(data_manifest.ref), model, train, cluster, store_cfg)
    log.info("training identity %s: run directory %s", identity, run_dir)
    run_app(launch)
    result = json.loads((run_dir / "result.json").read_text())
    shutil.copyfile(run_dir / "metrics.jsonl", Path(result["export_dir"]) / "training_metrics.jsonl")
    ckpt_ref = f"checkpoint/{model.name}@{result['checkpoint_version']}"
    # the version names the weights too: a rerun that trains other weights (a code change,
    # train.resume=never) publishes a new version instead of handing back the stored one
    weights_digest = sha256_file(Path(result["export_dir"]) / "model.safetensors")[:12]
    manifest = store.publish(
        "model",
        model.name,
        f"{identity}-{weights_digest}",
        Path(result["export_dir"]),
        metadata={
            "final_loss": result["final_loss"],
            "probe_loss": result["probe_loss"],
            "probe_blocks": result["probe_blocks"],
            "steps": result["steps"],
            "identity": identity,
            "train": as_plain_dict(train),
            "precision": result["precision"],
            "float8_linear_count": result["float8_linear_count"],
            "float8_linear_modules": result["float8_linear_modules"],
            "float8_cast_configs": result["float8_cast_configs"],
            "world": result["world"],
            "wrapped_modules": result["wrapped_modules"],
        },
        parents=[str(data_manifest.ref), ckpt_ref],
    )
    return TrainResult(identity, run_dir, manifest, result["final_loss"], result["checkpoint_version"], result)


def _kind_name_version(ref: str) -> tuple[str, str, str]:
    r = Ref.parse(ref)
    return r.kind, r.name, r.version
