"""The config schema: structured-config dataclasses that Hydra validates `conf/` against.

Defaults live in `conf/*.yaml`; the values here only make the dataclasses constructible.
Types are checked by OmegaConf when Hydra composes; `check_config` adds the rules that
types cannot express and names the offending key.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, TypeVar

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
GROUPS = ("data", "tokenizer", "model", "train", "preflight", "eval", "cluster", "store")


class Precision(str, Enum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp8 = "fp8"


class Fp8Recipe(str, Enum):
    tensorwise = "tensorwise"
    rowwise = "rowwise"
    rowwise_with_gw_hp = "rowwise_with_gw_hp"


class Parallelism(str, Enum):
    ddp = "ddp"
    fsdp = "fsdp"


class Scheduler(str, Enum):
    local_cwd = "local_cwd"
    kubernetes = "kubernetes"


class StoreBackend(str, Enum):
    local = "local"
    minio = "minio"


@dataclass
class DataConfig:
    name: str = "corpus"  # artifact name in the store
    paths: list[str] = field(default_factory=list)  # local jsonl/txt/parquet files or dirs
    hub_name: str | None = None  # a datasets hub name, used when paths is empty
    hub_config: str | None = None
    hub_split: str = "train"
    text_field: str = "text"
    min_chars: int = 1  # documents shorter than this (after strip) are dropped
    max_doc_bytes: int = 67108864  # a longer line in a text source is refused before loading
    dedup: bool = True  # drop exact duplicate documents
    val_fraction: float = 0.05
    split_seed: int = 0
    seq_len: int = 128  # tokens per training sample; blocks hold seq_len + 1
    num_proc: int = 1


@dataclass
class TokenizerConfig:
    pretrained: str | None = None  # hub name or local path; None trains a byte-level BPE
    vocab_size: int = 1024  # for the trained BPE
    min_frequency: int = 2


@dataclass
class ModelConfig:
    name: str = "tiny"
    vocab_size: int | None = None  # None: the dataset tokenizer's vocab
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 4
    ffn_hidden_size: int = 192
    max_seq_len: int = 128
    rope_theta: float = 10000.0
    tie_embeddings: bool = False


@dataclass
class TrainConfig:
    precision: Precision = Precision.fp32
    fp8_recipe: Fp8Recipe = Fp8Recipe.tensorwise
    activation_checkpointing: bool = False
    ac_every_n_blocks: int = 1  # checkpoint every n-th transformer block
    compile: bool | None = None  # torch.compile per block; None: on GPU, off on CPU
    parallelism: Parallelism = Parallelism.ddp
    micro_batch_size: int = 8
    grad_accum_steps: int = 1
    steps: int = 100
    lr: float = 3e-3
    warmup_steps: int = 10
    min_lr: float = 3e-4
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 0
    checkpoint_interval: int = 50
    checkpoint_keep: int = 2
    checkpoint_async: bool = False
    resume: str = "auto"  # auto | never | <checkpoint version>
    run_dir: str = "runs"  # logs, metrics and exports, one subdirectory per training identity
    checkpoint_dir: str | None = None  # None: <run_dir>/<identity>/checkpoints; shared storage in a cluster
    loss_scaling: bool = False  # dynamic loss scaling (GradScaler); for fp16-range gradients
    log_interval: int = 1
    max_bad_steps: int = 3  # consecutive non-finite steps before rolling back
    loss_spike_factor: float = 3.0
    straggler_interval: int = 20
    straggler_zscore: float = 5.0
    watchdog_timeout_s: float = 600.0
    peak_tflops: float | None = None  # device peak for MFU; None: preflight's measure


@dataclass
class PreflightConfig:
    gemm_size: int = 1024
    gemm_iters: int = 5
    membw_mb: int = 64
    allreduce_sizes_mb: list[float] = field(default_factory=lambda: [0.25, 1.0, 4.0])
    storage_probe_mb: int = 4
    zscore_threshold: float = 5.0
    floors: dict[str, float] = field(default_factory=dict)  # metric -> absolute minimum
    min_healthy_nodes: int = 1
    memory_safety: float = 0.9
    device_memory_gb: float | None = None  # None: measured (GPU) or host memory (CPU)
    quarantine: bool = False


@dataclass
class EvalConfig:
    val_blocks: int = 64  # 0 = the whole val split
    batch_size: int = 8
    loss_tolerance: float = 0.05  # validate: |stored model loss - recorded probe loss| allowed
    prompts: list[str] = field(default_factory=lambda: ["The "])
    max_new_tokens: int = 32
    lm_eval_tasks: list[str] = field(default_factory=list)
    baseline: str | None = None  # a model version in the store to compare against


@dataclass
class ClusterConfig:
    scheduler: Scheduler = Scheduler.local_cwd
    nodes: int = 1
    procs_per_node: int = 1
    image: str = "liftoff:latest"
    queue: str = "default"
    namespace: str = "kubeflow"
    service_account: str | None = None
    cpu: int = 2
    gpu: int = 0
    mem_mb: int = 4096
    rdzv_port: int = 0  # 0: a free port per job
    max_restarts: int = 0
    node_selector: dict[str, str] = field(default_factory=dict)


@dataclass
class StoreConfig:
    backend: StoreBackend = StoreBackend.local
    root: str = "artifacts"  # local backend: the directory; minio: a key prefix
    bucket: str = "liftoff"
    endpoint: str | None = None  # None: $MINIO_ENDPOINT
    secure: bool | None = None  # None: $MINIO_SECURE
    cache_dir: str = ".cache/liftoff"
    timeout_s: float = 30.0  # total time retries may take before the store is declared unreachable


@dataclass
class KfpConfig:
    """Where `liftoff submit` / `upload` talk to; not a pipeline parameter."""

    host: str | None = None  # None: $KF_PIPELINES_ENDPOINT
    namespace: str | None = None  # multi-user Kubeflow profile namespace
    experiment: str | None = None  # None: named after the sweep's overrides
    service_account: str | None = None  # runs execute as this (TorchX needs to create Volcano jobs)
    pipeline_name: str = "liftoff-pretrain"


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    preflight: PreflightConfig = field(default_factory=PreflightConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    kfp: KfpConfig = field(default_factory=KfpConfig)


GROUP_SCHEMAS = {
    "data": DataConfig,
    "tokenizer": TokenizerConfig,
    "model": ModelConfig,
    "train": TrainConfig,
    "preflight": PreflightConfig,
    "eval": EvalConfig,
    "cluster": ClusterConfig,
    "store": StoreConfig,
}

ConfigStore.instance().store(name="liftoff_schema", node=Config)


class ConfigError(ValueError):
    """A config value that is well-typed but cannot work; the message names the key."""


# Rules that read a second group, besides the group of the key they name.
CROSS_GROUP = {("data.seq_len", "model"), ("preflight.min_healthy_nodes", "cluster")}


def _needs(key: str) -> set[str]:
    return {key.split(".")[0]} | {group for k, group in CROSS_GROUP if k == key}


def _rules(cfg: Config) -> list[tuple[str, bool, str]]:
    d, m, t, c, p, e, tok = cfg.data, cfg.model, cfg.train, cfg.cluster, cfg.preflight, cfg.eval, cfg.tokenizer
    return [
        ("data.paths", bool(d.paths) or bool(d.hub_name), "give data.paths or data.hub_name"),
        ("data.seq_len", d.seq_len >= 2, f"must be >= 2, got {d.seq_len}"),
        ("data.seq_len", d.seq_len <= m.max_seq_len, f"{d.seq_len} exceeds model.max_seq_len={m.max_seq_len}"),
        ("data.val_fraction", 0.0 < d.val_fraction < 1.0, f"must be in (0, 1), got {d.val_fraction}"),
        ("data.num_proc", d.num_proc >= 1, f"must be >= 1, got {d.num_proc}"),
        ("data.min_chars", d.min_chars >= 1, f"must be >= 1, got {d.min_chars}"),
        (
            "tokenizer.vocab_size",
            tok.vocab_size >= 260,
            f"must be >= 260 (256 bytes + special tokens), got {tok.vocab_size}",
        ),
        ("model.vocab_size", m.vocab_size is None or m.vocab_size >= 1, f"must be >= 1, got {m.vocab_size}"),
        (
            "model.hidden_size",
            m.num_heads >= 1 and m.hidden_size % m.num_heads == 0,
            f"{m.hidden_size} is not divisible by model.num_heads={m.num_heads}",
        ),
        (
            "model.num_kv_heads",
            m.num_kv_heads >= 1 and m.num_heads % m.num_kv_heads == 0,
            f"model.num_heads={m.num_heads} is not divisible by {m.num_kv_heads}",
        ),
        (
            "model.head_dim",
            m.num_heads >= 1 and (m.hidden_size // max(m.num_heads, 1)) % 2 == 0,
            "hidden_size / num_heads must be even for rotary embeddings",
        ),
        ("model.num_layers", m.num_layers >= 1, f"must be >= 1, got {m.num_layers}"),
        ("model.ffn_hidden_size", m.ffn_hidden_size >= 1, f"must be >= 1, got {m.ffn_hidden_size}"),
        ("train.steps", t.steps >= 1, f"must be >= 1, got {t.steps}"),
        (
            "train.warmup_steps",
            0 <= t.warmup_steps < t.steps,
            f"{t.warmup_steps} must be >= 0 and < train.steps={t.steps}",
        ),
        ("train.lr", t.lr > 0, f"must be > 0, got {t.lr}"),
        ("train.min_lr", 0 <= t.min_lr <= t.lr, f"{t.min_lr} must be in [0, train.lr={t.lr}]"),
        ("train.micro_batch_size", t.micro_batch_size >= 1, f"must be >= 1, got {t.micro_batch_size}"),
        ("train.grad_accum_steps", t.grad_accum_steps >= 1, f"must be >= 1, got {t.grad_accum_steps}"),
        ("train.grad_clip", t.grad_clip >= 0, f"must be >= 0 (0 disables), got {t.grad_clip}"),
        ("train.checkpoint_interval", t.checkpoint_interval >= 1, f"must be >= 1, got {t.checkpoint_interval}"),
        ("train.checkpoint_keep", t.checkpoint_keep >= 1, f"must be >= 1, got {t.checkpoint_keep}"),
        ("train.ac_every_n_blocks", t.ac_every_n_blocks >= 1, f"must be >= 1, got {t.ac_every_n_blocks}"),
        ("train.max_bad_steps", t.max_bad_steps >= 1, f"must be >= 1, got {t.max_bad_steps}"),
        ("train.watchdog_timeout_s", t.watchdog_timeout_s > 0, f"must be > 0, got {t.watchdog_timeout_s}"),
        ("train.resume", bool(t.resume.strip()), "must be auto, never or a checkpoint version"),
        ("cluster.nodes", c.nodes >= 1, f"must be >= 1, got {c.nodes}"),
        ("cluster.procs_per_node", c.procs_per_node >= 1, f"must be >= 1, got {c.procs_per_node}"),
        ("cluster.rdzv_port", 0 <= c.rdzv_port <= 65535, f"must be a port or 0, got {c.rdzv_port}"),
        ("cluster.max_restarts", c.max_restarts >= 0, f"must be >= 0, got {c.max_restarts}"),
        (
            "preflight.min_healthy_nodes",
            1 <= p.min_healthy_nodes <= c.nodes,
            f"{p.min_healthy_nodes} must be in [1, cluster.nodes={c.nodes}]",
        ),
        ("preflight.memory_safety", 0 < p.memory_safety <= 1, f"must be in (0, 1], got {p.memory_safety}"),
        ("eval.batch_size", e.batch_size >= 1, f"must be >= 1, got {e.batch_size}"),
        ("eval.val_blocks", e.val_blocks >= 0, f"must be >= 0, got {e.val_blocks}"),
        ("store.timeout_s", cfg.store.timeout_s > 0, f"must be > 0, got {cfg.store.timeout_s}"),
    ]


def check_config(cfg: DictConfig | Config) -> None:
    """Raise ConfigError naming every key whose value is typed right but cannot work."""
    obj = OmegaConf.to_object(cfg) if isinstance(cfg, DictConfig) else cfg
    bad = [f"{key}: {msg}" for key, ok, msg in _rules(obj) if not ok]
    if bad:
        raise ConfigError("invalid config:\n  " + "\n  ".join(bad))


def checked_groups(**values: dict[str, Any]) -> dict[str, Any]:
    """The typed groups a stage receives as plain dicts (KFP parameters), re-validated with the
    compose-time types and rules that involve only these groups: a group edited as JSON in the
    Kubeflow UI is held to the same rules as the command line. ConfigError names the key."""
    from omegaconf.errors import OmegaConfBaseException

    typed = {}
    for name, value in values.items():
        try:
            typed[name] = group_from_dict(GROUP_SCHEMAS[name], value)
        except OmegaConfBaseException as e:
            detail = str(e.msg).splitlines()[0]
            raise ConfigError(f"invalid config: {name}.{getattr(e, 'full_key', '') or '?'}: {detail}") from None
    cfg = Config(**typed)
    bad = [f"{key}: {msg}" for key, ok, msg in _rules(cfg) if not ok and _needs(key) <= typed.keys()]
    if bad:
        raise ConfigError("invalid config: " + "; ".join(bad))
    return typed


def compose(overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """Compose `conf/` with Hydra overrides, type-check and rule-check it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = hydra_compose(config_name="config", overrides=list(overrides))
    check_config(cfg)
    return cfg


T = TypeVar("T")


def group_from_dict(schema: type[T], values: dict[str, Any]) -> T:
    """Rebuild one typed group from the plain dict a KFP component receives."""
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), _ints_back(schema, values)))


def _ints_back(schema: type, values: dict[str, Any]) -> dict[str, Any]:
    """KFP carries dict parameters as protobuf Structs, where every number is a float:
    turn integral floats back into ints wherever the schema wants an int."""

    def fix(hint, value):
        if dataclasses.is_dataclass(hint) and isinstance(value, dict):
            return _ints_back(hint, value)
        origin, args = typing.get_origin(hint), typing.get_args(hint)
        if origin is list and isinstance(value, list):
            return [fix(args[0], v) for v in value]
        wants_int = hint is int or (origin in (typing.Union, types.UnionType) and int in args)
        return int(value) if wants_int and isinstance(value, float) and value.is_integer() else value

    hints = typing.get_type_hints(schema)
    return {key: fix(hints.get(key), value) for key, value in values.items()}


def group_dicts(cfg: DictConfig) -> dict[str, dict[str, Any]]:
    """The composed config as one plain dict per group: the pipeline's parameters.

    KFP parameters cannot hold None, so unset optional keys are left out;
    `group_from_dict` restores them from the schema, where every Optional defaults to None.
    """
    return {g: drop_none(OmegaConf.to_container(cfg[g], resolve=True, enum_to_str=True)) for g in GROUPS}


def as_plain_dict(group) -> dict:
    """A typed group as JSON-able values (enums by value): for specs, manifests and hashes."""
    return json.loads(json.dumps(dataclasses.asdict(group), default=lambda v: getattr(v, "value", str(v))))


def drop_none(d: dict) -> dict:
    """Without its None values, recursively (KFP parameters cannot hold None)."""
    return {k: drop_none(v) if isinstance(v, dict) else v for k, v in d.items() if v is not None}
