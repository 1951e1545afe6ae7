"""The train stage: check the inputs, launch the workers with TorchX, publish the model."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from components.config import ClusterConfig, ModelConfig, Precision, TrainConfig
from components.store import ArtifactStore, Manifest, Ref
from components.tokenize.blocks import load_stats, open_token_blocks
from components.train.data import DataFitError
from components.train.launcher import run_app
from components.train.precision import PrecisionError
from components.train.resume import ResumeError, check_shape

log = logging.getLogger(__name__)

# Train settings that do not change the math: a run differing only in these continues the
# same training (same checkpoints); anything else is a new training identity.
NOT_IDENTITY = {
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
    "faults",
    "activation_checkpointing",
    "ac_every_n_blocks",
}


class TrainInputError(ValueError):
    pass


@dataclass
class TrainResult:
    identity: str
    run_dir: Path
    model: Manifest
    final_loss: float
    checkpoint_version: str
    result: dict


def plain(cfg) -> dict:
    return json.loads(json.dumps(asdict(cfg), default=lambda v: getattr(v, "value", str(v))))


def drop_none(d: dict) -> dict:
    return {k: drop_none(v) if isinstance(v, dict) else v for k, v in d.items() if v is not None}


def training_identity(dataset: str, model: ModelConfig, train: TrainConfig, cluster: ClusterConfig) -> str:
    math = {k: v for k, v in plain(train).items() if k not in NOT_IDENTITY}
    ident = {
        "dataset": dataset,
        "model": drop_none(plain(model)),
        "train": math,
        "world": cluster.nodes * cluster.procs_per_node,
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def check_inputs(
    data_dir: Path, model: ModelConfig, train: TrainConfig, cluster: ClusterConfig, store: ArtifactStore
) -> None:
    """Everything that would fail training, checked before anything is launched."""
    stats = load_stats(data_dir)
    if model.vocab_size is not None and model.vocab_size < stats["vocab_size"]:
        raise TrainInputError(
            f"dataset/model vocab mismatch: the dataset's tokenizer has {stats['vocab_size']} "
            f"tokens but model.vocab_size={model.vocab_size}"
        )
    if stats["seq_len"] > model.max_seq_len:
        raise TrainInputError(
            f"the dataset's blocks hold seq_len={stats['seq_len']} tokens, more than "
            f"model.max_seq_len={model.max_seq_len}"
        )
    world = cluster.nodes * cluster.procs_per_node
    per_step = train.micro_batch_size * train.grad_accum_steps * world
    n_blocks = len(open_token_blocks(data_dir, "train"))
    if n_blocks < per_step:
        raise DataFitError(
            f"train.micro_batch_size={train.micro_batch_size} x train.grad_accum_steps="
            f"{train.grad_accum_steps} x world size {world} = {per_step} blocks per step, but the "
            f"train split has only {n_blocks} blocks"
        )
    if train.precision == Precision.fp8:
        head_dim = model.hidden_size // model.num_heads
        dims = {
            "hidden_size": model.hidden_size,
            "kv projection": model.num_kv_heads * head_dim,
            "ffn_hidden_size": model.ffn_hidden_size,
        }
        if any(v % 16 for v in (model.hidden_size,)) or all(v % 16 for v in dims.values()):
            raise PrecisionError(
                f"train.precision=fp8 but no Linear layer has both dims divisible by 16 "
                f"({', '.join(f'{k}={v}' for k, v in dims.items())})"
            )
    if train.resume not in ("auto", "never"):
        ref = Ref("checkpoint", model.name, train.resume)
        if not store.exists(ref):
            raise ResumeError(f"train.resume={train.resume}: no {ref} in {store.description}")
        check_shape(store.manifest(ref).metadata, model, f"train.resume={train.resume}")


def run_train(
    dataset: str, model: ModelConfig, train: TrainConfig, cluster: ClusterConfig, store_cfg, store: ArtifactStore
) -> TrainResult:
    data_manifest = store.resolve(*_kind_name_version(dataset))
    data_dir = store.fetch(data_manifest)  # cached here, so local ranks find it verified
    check_inputs(data_dir, model, train, cluster, store)
    identity = training_identity(str(data_manifest.ref), model, train, cluster)
    run_dir = Path(train.run_dir).resolve() / identity
    spec = {
        "train": plain(train),
        "model": drop_none(plain(model)),
        "store": drop_none(plain(store_cfg)),
        "dataset": str(data_manifest.ref),
        "identity": identity,
        "run_dir": str(run_dir),
    }
    log.info("training identity %s: run directory %s", identity, run_dir)
    run_app("components.train.worker", spec, cluster, f"train-{identity[:8]}", run_dir / "logs")
    result = json.loads((run_dir / "result.json").read_text())
    shutil.copyfile(run_dir / "metrics.jsonl", Path(result["export_dir"]) / "training_metrics.jsonl")
    ckpt_ref = f"checkpoint/{model.name}@{result['checkpoint_version']}"
    manifest = store.publish(
        "model",
        model.name,
        identity,
        Path(result["export_dir"]),
        metadata={
            "final_loss": result["final_loss"],
            "steps": result["steps"],
            "identity": identity,
            "train": plain(train),
        },
        parents=[str(data_manifest.ref), ckpt_ref],
    )
    return TrainResult(identity, run_dir, manifest, result["final_loss"], result["checkpoint_version"], result)


def _kind_name_version(ref: str) -> tuple[str, str, str]:
    r = Ref.parse(ref)
    return r.kind, r.name, r.version
