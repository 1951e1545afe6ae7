"""The config schema: structured-config dataclasses that Hydra validates `conf/` against.

Every default lives in `conf/*.yaml`: each field here is `MISSING`, so a key that `conf/`
does not set fails at compose time. Types are checked by OmegaConf when Hydra composes;
`BOUNDS` holds the range of every numeric key, one table; each group's `check()` holds the
rules between keys that types cannot express (named by the key they judge), and
`check_config` runs them all.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import re
import types
import typing
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, TypeVar

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
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
    name: str = MISSING  # artifact name in the store
    paths: list[str] = MISSING  # local jsonl/txt/parquet files or dirs, or s3://bucket/prefix on the store's endpoint
    hub_name: str | None = MISSING  # a datasets hub name, used when paths is empty
    hub_config: str | None = MISSING
    hub_split: str = MISSING
    hub_revision: str | None = MISSING  # the hub dataset's commit: a name alone moves upstream
    text_field: str = MISSING
    min_chars: int = MISSING  # documents shorter than this (after strip) are dropped
    max_doc_bytes: int = MISSING  # a longer line in a text source is refused before loading
    dedup: bool = MISSING  # drop exact duplicate documents
    val_fraction: float = MISSING
    split_seed: int = MISSING
    seq_len: int = MISSING  # tokens per training sample; blocks hold seq_len + 1
    num_proc: int = MISSING  # tokenizer processes per shard task
    shards: int = MISSING  # source partitions, each tokenized by its own task (pod)
    parallelism: int = MISSING  # shard tasks at once (compiled into the pipeline's ParallelFor)
    cache_gb: float = MISSING  # each node's bound on the train shards it keeps on disk

    def check(self, model: ModelConfig | None = None) -> list[str]:
        pinned = not self.hub_name or bool(self.paths) or is_commit(self.hub_revision)
        rules = [
            ("data.paths", bool(self.paths) or bool(self.hub_name), "give data.paths or data.hub_name"),
            (
                "data.hub_revision",
                pinned,
                f"pin data.hub_name={self.hub_name} to a commit of the hub repo, its 40-hex sha (a branch or tag "
                f"moves), got {self.hub_revision}",
            ),
        ]
        if model is not None:  # blocks longer than the model's positions cannot train
            ok = self.seq_len <= model.max_seq_len
            rules.append(("data.seq_len", ok, f"{self.seq_len} exceeds model.max_seq_len={model.max_seq_len}"))
        return failed(rules)


def is_commit(revision: str | None) -> bool:
    """A hub revision that cannot move: a full commit sha, not a branch or a tag."""
    return bool(revision) and re.fullmatch(r"[0-9a-f]{40}", revision) is not None


def from_hub(tok: TokenizerConfig) -> bool:
    """tokenizer.pretrained names a hub repo, not a local directory (absolute, ./ or ~ paths)."""
    return bool(tok.pretrained) and not tok.pretrained.startswith(("/", ".", "~"))


@dataclass
class TokenizerConfig:
    pretrained: str | None = MISSING  # hub name or local path; None trains a byte-level BPE
    revision: str | None = MISSING  # the hub repo's commit, required for a hub name
    vocab_size: int = MISSING  # for the trained BPE
    min_frequency: int = MISSING
    sample_mb: int = MISSING  # the BPE trains once, on the first sample_mb of training documents

    def check(self) -> list[str]:
        pinned = not from_hub(self) or is_commit(self.revision)
        return failed(
            [
                (
                    "tokenizer.revision",
                    pinned,
                    f"pin tokenizer.pretrained={self.pretrained} to a commit of the hub repo, its 40-hex sha "
                    f"(a branch or tag moves), got {self.revision}",
                ),
            ]
        )


@dataclass
class ModelConfig:
    name: str = MISSING
    vocab_size: int | None = MISSING  # None: the dataset tokenizer's vocab
    hidden_size: int = MISSING
    num_layers: int = MISSING
    num_heads: int = MISSING
    num_kv_heads: int = MISSING
    ffn_hidden_size: int = MISSING
    max_seq_len: int = MISSING
    rope_theta: float = MISSING
    tie_embeddings: bool = MISSING

    def check(self) -> list[str]:
        heads, kv = self.num_heads, self.num_kv_heads
        if heads < 1 or kv < 1:
            return []  # out of BOUNDS, which problems() reports (and then skips these rules)
        return failed([
            ("model.hidden_size", self.hidden_size % heads == 0,
             f"model.hidden_size={self.hidden_size} is not divisible by model.num_heads={heads}"),
            ("model.num_kv_heads", heads % kv == 0,
             f"model.num_heads={heads} is not divisible by model.num_kv_heads={kv} "
             "(each kv head serves a whole group of query heads)"),
            ("model.head_dim", (self.hidden_size // heads) % 2 == 0,
             "hidden_size / num_heads must be even for rotary embeddings"),
        ])  # fmt: skip


@dataclass
class TrainConfig:
    precision: Precision = MISSING
    fp8_recipe: Fp8Recipe = MISSING
    activation_checkpointing: bool = MISSING
    ac_every_n_blocks: int = MISSING  # checkpoint every n-th transformer block
    compile: bool | None = MISSING  # torch.compile per block; None: on GPU, off on CPU
    parallelism: Parallelism = MISSING
    micro_batch_size: int = MISSING
    grad_accum_steps: int = MISSING
    steps: int = MISSING
    lr: float = MISSING
    warmup_steps: int = MISSING
    min_lr: float = MISSING
    weight_decay: float = MISSING
    beta1: float = MISSING
    beta2: float = MISSING
    grad_clip: float = MISSING
    seed: int = MISSING
    checkpoint_interval: int = MISSING
    checkpoint_keep: int = MISSING
    checkpoint_async: bool = MISSING
    resume: str = MISSING  # auto | never | <checkpoint version>
    run_dir: str = MISSING  # logs, metrics and exports, one subdirectory per training identity
    checkpoint_dir: str | None = MISSING  # None: <run_dir>/<identity>/checkpoints; shared storage in a cluster
    loss_scaling: bool = MISSING  # dynamic loss scaling (GradScaler); for fp16-range gradients
    log_interval: int = MISSING
    val_interval: int = MISSING  # steps between val-loss measurements on fixed held-out blocks; 0 = off
    max_bad_steps: int = MISSING  # consecutive non-finite steps before rolling back
    loss_spike_factor: float = MISSING
    straggler_interval: int = MISSING
    straggler_zscore: float = MISSING
    watchdog_timeout_s: float = MISSING
    peak_tflops: float | None = MISSING  # device peak for MFU; None: preflight's measure
    metrics_port: int = MISSING  # each node serves Prometheus metrics there (locally: + node index); 0 = off
    profile_poll_steps: int = MISSING  # steps between looks for a `liftoff profile` request in the store

    def check(self) -> list[str]:
        return failed([
            ("train.warmup_steps", 0 <= self.warmup_steps < self.steps,
             f"{self.warmup_steps} must be >= 0 and < train.steps={self.steps}"),
            ("train.min_lr", 0 <= self.min_lr <= self.lr, f"{self.min_lr} must be in [0, train.lr={self.lr}]"),
            ("train.resume", bool(self.resume.strip()), "must be auto, never or a checkpoint version"),
        ])  # fmt: skip


# what preflight measures per node that a floor may hold (the leave-one-out z-score too);
# `gemm_tflops_<dtype>`, `allreduce_busbw_gbps_<size>mb` or `allreduce_busbw_gbps` (its largest size)
PERF_METRICS = ("gemm_tflops_", "membw_gbps", "allreduce_busbw_gbps", "storage_read_mbps", "storage_roundtrip_mbps")


@dataclass
class PreflightConfig:
    gemm_size: int = MISSING
    gemm_iters: int = MISSING
    membw_mb: int = MISSING
    membw_mb_gpu: int = MISSING
    allreduce_sizes_mb: list[float] = MISSING
    allreduce_sizes_mb_gpu: list[float] = MISSING
    read_probe_mb: int = MISSING  # a ranged read of one data shard, timed on every node
    zscore_threshold: float = MISSING
    floors: dict[str, float] = MISSING  # metric -> absolute minimum, over the device's (device_floors)
    device_floors: bool = MISSING  # cluster.gpu_type's absolute floors (components/devices.py) apply too
    min_healthy_nodes: int | None = MISSING  # None: every node (train's gang needs cluster.nodes)
    memory_safety: float = MISSING
    device_memory_gb: float | None = MISSING  # None: measured (GPU) or host memory (CPU)
    quarantine: bool = MISSING

    def check(self, cluster: ClusterConfig | None = None) -> list[str]:
        unknown = sorted(k for k in self.floors if not k.startswith(PERF_METRICS))
        measured = ", ".join(PERF_METRICS)
        why = f"{', '.join(unknown)}: not a metric preflight measures (names start with {measured})"
        rules = [("preflight.floors", not unknown, why)]
        if cluster is not None:  # the gate needs at least this many of the nodes the job asks for
            n = self.min_healthy_nodes
            ok = n is None or 1 <= n <= cluster.nodes
            rules.append(("preflight.min_healthy_nodes", ok, f"{n} must be in [1, cluster.nodes={cluster.nodes}]"))
        return failed(rules)


# what the evaluate stage records in its artifact's metrics (components/evaluate/stage.py)
EVAL_METRICS = ("val_loss", "val_perplexity", "val_bits_per_byte", "unigram_perplexity", "perplexity_vs_unigram",
                "inference_tokens_per_s", "val_tokens")  # fmt: skip


@dataclass
class EvalConfig:
    val_blocks: int = MISSING  # 0 = the whole val split
    batch_size: int = MISSING
    loss_tolerance: float = MISSING  # validate: |stored model loss - recorded probe loss| allowed
    prompts: list[str] = MISSING
    max_new_tokens: int = MISSING
    lm_eval_tasks: list[str] = MISSING
    baseline: str | None = MISSING  # a model version in the store to compare against
    objective: str = MISSING  # the metric a Bayesian sweep optimizes (pipelines/sweep.py)

    def check(self) -> list[str]:
        known = self.objective in EVAL_METRICS or self.objective.startswith("lm_eval/")
        why = f"{self.objective!r} is not a metric evaluate records ({', '.join(EVAL_METRICS)}, lm_eval/...)"
        return failed([("eval.objective", known, why)])


@dataclass
class ClusterConfig:
    scheduler: Scheduler = MISSING
    nodes: int = MISSING
    procs_per_node: int = MISSING
    image: str = MISSING  # the stage image: every KFP task and every TorchX replica runs it
    image_pull_policy: str = MISSING  # Always for a mutable tag, so driver and workers run one code
    queue: str = MISSING
    namespace: str | None = MISSING  # None: the namespace the driver pod runs in (a profile's, on multi-user Kubeflow)
    service_account: str | None = MISSING
    image_pull_secrets: list[str] = MISSING
    cpu: int = MISSING
    gpu: int = MISSING
    mem_mb: int = MISSING
    rdzv_port: int = MISSING  # 0: a free port per job
    max_restarts: int = MISSING
    node_selector: dict[str, str] = MISSING
    gpu_type: str | None = MISSING  # "H200": the planner's device (components/devices.py); None: none known
    # the fabric and the disks, on every replica pod (components/k8s.py `finish_job`)
    extra_resources: dict[str, int] = MISSING  # requested = limit per replica: {rdma/ib: 8}
    capabilities: list[str] = MISSING  # added to each replica container: [IPC_LOCK] for RDMA
    pod_annotations: dict[str, str] = MISSING  # Multus: {k8s.v1.cni.cncf.io/networks: ...}
    env: dict[str, str] = MISSING  # NCCL_* / GLOO_* / UCX_* for every replica
    host_network: bool = MISSING  # the node's network namespace (RDMA without Multus)
    volumes: list[VolumeConfig] = MISSING  # the data cache and node checkpoints: local NVMe, a PVC, emptyDir
    ephemeral_storage_gb: int = MISSING  # requested per replica for its writable layer (0: none)
    job_ttl_s: int = MISSING  # Volcano deletes a finished job after this long (ttlSecondsAfterFinished)
    pending_timeout_s: float = MISSING  # a gang unscheduled this long fails the attempt, naming why

    def check(self) -> list[str]:
        from components.devices import DEVICES, device

        known = ", ".join(d.key for d in DEVICES)
        reserved = sorted(k for k in self.env if k in RESERVED_ENV or k.startswith(("TORCHX_", "LIFTOFF_")))
        names, paths = [v.name for v in self.volumes], [v.mount_path.rstrip("/") for v in self.volumes]
        bad_env = sorted(k for k in self.env if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k))
        expanded = sorted(k for k, v in self.env.items() if "$(" in str(v))  # Kubernetes would expand $(VAR)
        return failed([
            ("cluster.gpu_type", self.gpu_type is None or device(self.gpu_type) is not None,
             f"unknown {self.gpu_type!r}: one of {known}, or null (then preflight.device_memory_gb "
             "and train.peak_tflops)"),
            ("cluster.image_pull_policy", self.image_pull_policy in PULL_POLICIES,
             f"must be one of {', '.join(PULL_POLICIES)}, got {self.image_pull_policy!r}"),
            ("cluster.env", not reserved, f"{', '.join(reserved)} set by liftoff itself: not configurable"),
            ("cluster.env", not bad_env, f"not an environment variable name: {', '.join(bad_env)}"),
            ("cluster.env", not expanded, f"$(...) in {', '.join(expanded)}: Kubernetes expands it; write $$(...)"),
            ("cluster.volumes", len(set(names)) == len(names) and "dshm" not in names,
             f"names must be unique and not dshm (the /dev/shm volume), got {names}"),
            ("cluster.volumes", len(set(paths)) == len(paths) and "/dev/shm" not in paths,
             f"mount paths must be unique and not /dev/shm, got {paths}"),
        ] + [rule for v in self.volumes for rule in v.rules()])  # fmt: skip


VOLUME_KINDS = ("emptyDir", "hostPath", "pvc")
RESERVED_ENV = (
    *("MINIO_ACCESS_KEY", "MINIO_SECRET_KEY", "MINIO_ENDPOINT", "NODE_NAME", "OMP_NUM_THREADS"),
    *("LOGLEVEL", "PYTHONWARNINGS", "PYTHONPATH", "PATH"),
)


@dataclass
class VolumeConfig:
    """One volume on every replica pod: `emptyDir` (size_gb: its sizeLimit, and requested as
    ephemeral storage; medium Memory for tmpfs), `hostPath` (host_path: a node's local NVMe)
    or `pvc` (claim_name: a PersistentVolumeClaim in the run's namespace)."""

    name: str = MISSING
    mount_path: str = MISSING
    kind: str = "emptyDir"
    size_gb: int | None = None
    medium: str = ""
    host_path: str | None = None
    claim_name: str | None = None

    def rules(self) -> list[tuple[str, bool, str]]:
        key = f"cluster.volumes[{self.name}]"
        return [
            (key, bool(re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", self.name)),
             "name must be a DNS label (lowercase letters, digits, '-')"),
            (key, self.kind in VOLUME_KINDS, f"kind must be one of {', '.join(VOLUME_KINDS)}, got {self.kind!r}"),
            (key, self.mount_path.startswith("/"), f"mount_path must be absolute, got {self.mount_path!r}"),
            (key, self.kind != "hostPath" or bool(self.host_path), "kind hostPath needs host_path"),
            (key, self.kind != "pvc" or bool(self.claim_name), "kind pvc needs claim_name"),
            (key, self.size_gb is None or self.size_gb > 0, f"size_gb must be > 0, got {self.size_gb}"),
            (key, self.medium in ("", "Memory"), f"medium must be '' or Memory, got {self.medium!r}"),
        ]  # fmt: skip


@dataclass
class StoreConfig:
    backend: StoreBackend = MISSING
    root: str = MISSING  # local backend: the directory; minio: a key prefix
    bucket: str = MISSING
    endpoint: str | None = MISSING  # None: $MINIO_ENDPOINT
    secure: bool | None = MISSING  # None: $MINIO_SECURE
    cache_dir: str = MISSING
    timeout_s: float = MISSING  # total time retries may take before the store is declared unreachable
    secret_name: str = MISSING  # on a cluster: the Kubernetes Secret holding the MinIO keys

    def check(self) -> list[str]:
        return []  # store.timeout_s is a range: BOUNDS


@dataclass
class KfpConfig:
    """Where `liftoff submit` / `upload` talk to; not a pipeline parameter."""

    host: str | None = MISSING  # None: $KF_PIPELINES_ENDPOINT
    namespace: str | None = MISSING  # multi-user Kubeflow profile namespace
    experiment: str | None = MISSING  # None: named after the sweep's overrides
    service_account: str | None = MISSING  # runs execute as this (TorchX needs to create Volcano jobs)
    pipeline_name: str = MISSING
    wait_timeout_s: float = MISSING  # `liftoff submit --wait` gives up after this long
    task_cpu: float = MISSING  # CPU request of every KFP task's pod (requests: never BestEffort, evicted first)
    task_memory_gb: float = MISSING  # memory request of every KFP task's pod ...
    eval_memory_gb: float = MISSING  # ... but validate and evaluate, which load the model in their own pod
    task_retries: int = MISSING  # KFP reruns a task whose pod failed (evicted, its node lost)

    def check(self) -> list[str]:
        return failed([("kfp.pipeline_name", bool(self.pipeline_name.strip()), "must not be empty")])


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


def failed(rules: list[tuple[str, bool, str]]) -> list[str]:
    """`key: message` for each (key, holds, message) rule that does not hold; a message that
    already names its key with a value (`model.hidden_size=64 is not ...`) stands alone."""
    return [message if f"{key}=" in message else f"{key}: {message}" for key, holds, message in rules if not holds]


# The range of every numeric key, in one table: `>= a`, `> a`, or an interval `[a, b)` (any
# of `[ ( ) ]`), with an optional note. A float must be finite as well (OmegaConf reads `inf`
# and `nan` as floats: `train.lr=inf` would reach training and fail there), None passes an
# optional key, and a list's items and a dict's values are each held to the bound. Rules
# between keys (warmup < steps, heads divisible by kv heads) stay in each group's check();
# a test asserts every numeric field is here or in NOT_BOUNDED.
BOUNDS: dict[str, str | tuple[str, str]] = {
    "data.min_chars": ">= 1",
    "data.max_doc_bytes": ">= 1",
    "data.val_fraction": "(0, 1)",
    "data.seq_len": ">= 2",
    "data.num_proc": ">= 1",
    "data.shards": ">= 1",
    "data.parallelism": ">= 1",
    "data.cache_gb": "> 0",
    "tokenizer.vocab_size": (">= 260", "256 bytes + special tokens"),
    "tokenizer.min_frequency": ">= 0",
    "tokenizer.sample_mb": ">= 1",
    "model.vocab_size": ">= 1",
    "model.hidden_size": ">= 1",
    "model.num_layers": ">= 1",
    "model.num_heads": ">= 1",
    "model.num_kv_heads": ">= 1",
    "model.ffn_hidden_size": ">= 1",
    "model.max_seq_len": ">= 1",
    "model.rope_theta": "> 0",
    "train.ac_every_n_blocks": ">= 1",
    "train.micro_batch_size": ">= 1",
    "train.grad_accum_steps": ">= 1",
    "train.steps": ">= 1",
    "train.lr": "> 0",
    "train.warmup_steps": ">= 0",
    "train.min_lr": ">= 0",
    "train.weight_decay": ">= 0",
    "train.beta1": "[0, 1)",  # torch's Adam refuses any other
    "train.beta2": "[0, 1)",
    "train.grad_clip": (">= 0", "0 disables"),
    "train.seed": ">= 0",  # numpy's SeedSequence takes no negative seed
    "train.checkpoint_interval": ">= 1",
    "train.checkpoint_keep": ">= 1",
    "train.log_interval": ">= 1",
    "train.val_interval": (">= 0", "0 disables"),
    "train.max_bad_steps": ">= 1",
    "train.loss_spike_factor": ("> 1", "times the running median loss"),
    "train.straggler_interval": ">= 1",
    "train.straggler_zscore": "> 0",
    "train.watchdog_timeout_s": "> 0",
    "train.metrics_port": ("[0, 65535]", "0 disables"),
    "train.profile_poll_steps": ">= 1",
    "train.peak_tflops": "> 0",
    "preflight.gemm_size": ">= 1",
    "preflight.gemm_iters": ">= 1",
    "preflight.membw_mb": ">= 1",
    "preflight.membw_mb_gpu": ">= 1",
    "preflight.allreduce_sizes_mb": "> 0",
    "preflight.allreduce_sizes_mb_gpu": "> 0",
    "preflight.read_probe_mb": ">= 1",
    "preflight.zscore_threshold": "> 0",
    "preflight.floors": ">= 0",
    "preflight.min_healthy_nodes": ">= 1",
    "preflight.memory_safety": "(0, 1]",
    "preflight.device_memory_gb": "> 0",
    "eval.val_blocks": (">= 0", "0 = the whole val split"),
    "eval.batch_size": ">= 1",
    "eval.loss_tolerance": "> 0",
    "eval.max_new_tokens": ">= 1",
    "cluster.nodes": ">= 1",
    "cluster.procs_per_node": ">= 1",
    "cluster.cpu": ">= 1",
    "cluster.gpu": ">= 0",
    "cluster.mem_mb": ">= 1",
    "cluster.rdzv_port": ("[0, 65535]", "0: a free port per job"),
    "cluster.max_restarts": ">= 0",
    "cluster.extra_resources": ">= 1",
    "cluster.ephemeral_storage_gb": (">= 0", "0: no request"),
    "cluster.job_ttl_s": ">= 0",
    "cluster.pending_timeout_s": "> 0",
    "store.timeout_s": "> 0",
    "kfp.wait_timeout_s": "> 0",
    "kfp.task_cpu": "> 0",
    "kfp.task_memory_gb": "> 0",
    "kfp.eval_memory_gb": "> 0",
    "kfp.task_retries": ">= 0",
}
NOT_BOUNDED = {"data.split_seed": "any int keys the split's hash"}

_BOUND = re.compile(r"(?P<op>>=?) (?P<low>\S+)|(?P<lb>[\[(])(?P<a>\S+), (?P<b>\S+)(?P<rb>[\])])")


def _within(value: float, bound: str) -> bool:
    m = _BOUND.fullmatch(bound)
    if m is None:
        raise ValueError(f"not a bound: {bound!r}")
    if m["op"]:
        return value >= float(m["low"]) if m["op"] == ">=" else value > float(m["low"])
    a, b = float(m["a"]), float(m["b"])
    return (a <= value if m["lb"] == "[" else a < value) and (value <= b if m["rb"] == "]" else value < b)


def out_of_bounds(name: str, group: Any) -> list[str]:
    """`key: must be ..., got ...` for each of one group's values outside its BOUNDS entry."""
    found = []
    for f in dataclasses.fields(group):
        key, value = f"{name}.{f.name}", getattr(group, f.name)
        if key not in BOUNDS or value is None:
            continue
        bound, note = BOUNDS[key] if isinstance(BOUNDS[key], tuple) else (BOUNDS[key], "")
        if isinstance(value, dict):
            items = [(f"{key}.{k}", v) for k, v in value.items()]
        elif isinstance(value, list):
            items = [(f"{key}[{i}]", v) for i, v in enumerate(value)]
        else:
            items = [(key, value)]
        for where, v in items:
            finite = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
            if not finite or not _within(v, bound):
                what = bound if bound[0] in "<>" else f"in {bound}"
                what = what if finite else f"a finite number {what}"
                found.append(f"{where}: must be {what}{f' ({note})' if note else ''}, got {v}")
    return found


def problems(groups: dict[str, Any]) -> list[str]:
    """Every key out of its BOUNDS first; then the rules between keys of each group whose
    values are all in range (and the rules that read a second group when both are here and in
    range): a rule such as `hidden_size % num_heads` may assume sane values."""
    ranges = {name: out_of_bounds(name, group) for name, group in groups.items()}
    found = [message for messages in ranges.values() for message in messages]
    sane = {name: group for name, group in groups.items() if not ranges[name]}
    for name, group in sane.items():
        if name == "data":
            found += group.check(model=sane.get("model"))
        elif name == "preflight":
            found += group.check(cluster=sane.get("cluster"))
        else:
            found += group.check()
    return found


def check_config(cfg: DictConfig | Config) -> None:
    """Raise ConfigError naming every key whose value is typed right but cannot work."""
    obj = OmegaConf.to_object(cfg) if isinstance(cfg, DictConfig) else cfg
    bad = problems({f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)})
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
    bad = problems(typed)
    if bad:
        raise ConfigError("invalid config: " + "; ".join(bad))
    return typed


def compose(overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """Compose `conf/` with Hydra overrides, type-check and rule-check it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    bad = [msg for o in overrides if (msg := unknown_key(o.partition("=")[0]))]
    if bad:  # before Hydra, whose own message suggests `+key`: adding a key the code never reads
        raise ConfigError("invalid config: " + "; ".join(bad))
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = hydra_compose(config_name="config", overrides=list(overrides))
    added = extra_keys(cfg)
    if added:  # `+train.lrr=1` or `++train.lrr=1`: a key no code reads would be ignored silently
        raise ConfigError("invalid config: " + "; ".join(added))
    check_config(cfg)
    return cfg


def config_groups() -> dict[str, list[str]]:
    """Each config group (a folder of conf/) and its options (the YAML files in it)."""
    return {d.name: sorted(f.stem for f in d.glob("*.yaml")) for d in sorted(CONF_DIR.iterdir()) if d.is_dir()}


def _no_such_key(key: str, at: int, known: list[str]) -> str:
    """`key is not a config key; did you mean ...?`: its `at`-th part replaced by the closest of `known`."""
    parts = key.split(".")
    close = difflib.get_close_matches(parts[at], known, n=1, cutoff=0.6)
    if not close:
        where = "at the top" if at == 0 else "of " + ".".join(parts[:at])
        return f"{key} is not a config key; the keys {where} are {', '.join(known)}"
    return f"{key} is not a config key; did you mean {'.'.join([*parts[:at], close[0], *parts[at + 1 :]])}?"


def unknown_key(key: str) -> str | None:
    """Why an override's key (`train.lrr`, `modle`) names nothing in the schema, or None when it
    does or cannot be judged here: an add/delete (`+`, `~`), a package (`@`), Hydra's own
    `hydra.*`, or a key inside a dict or list field (`cluster.env.NCCL_DEBUG`), which holds any key."""
    if not key or key.startswith(("+", "~")) or "@" in key or key.split(".")[0] == "hydra":
        return None
    schema = Config
    for at, part in enumerate(key.split(".")):
        if not dataclasses.is_dataclass(schema):
            return None
        hints = typing.get_type_hints(schema)
        groups = config_groups() if at == 0 else {}
        if part not in hints and part not in groups:
            return _no_such_key(key, at, sorted({*hints, *groups}) if at == 0 else list(hints))
        schema = hints.get(part)
    return None


def extra_keys(cfg: DictConfig, schema: type = Config, within: str = "") -> list[str]:
    """A message for each key of the composed config that its schema does not have."""
    hints = typing.get_type_hints(schema)
    found = []
    for key in cfg.keys():
        if key not in hints:
            found.append(_no_such_key(f"{within}{key}", within.count("."), list(hints)))
        elif dataclasses.is_dataclass(hints[key]) and isinstance(cfg[key], DictConfig):
            found += extra_keys(cfg[key], hints[key], f"{within}{key}.")
    return found


T = TypeVar("T")


def group_from_dict(schema: type[T], values: dict[str, Any]) -> T:
    """Rebuild one typed group from the plain dict a KFP component receives. KFP parameters
    cannot hold None, so `group_dicts` leaves unset optional keys out: they come back as None."""
    hints = typing.get_type_hints(schema)
    unset = {
        f.name: None
        for f in dataclasses.fields(schema)
        if f.name not in values and type(None) in typing.get_args(hints[f.name])
    }
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), {**unset, **_ints_back(schema, values)}))


@functools.cache
def _conf_defaults() -> Config:
    return OmegaConf.to_object(compose(["~experiment"]))


def defaults(group: str, **values: Any) -> Any:
    """One group as `conf/` sets it by default (no experiment preset), with `values` replaced:
    for code and tests that need a typed group outside a composed run."""
    return dataclasses.replace(getattr(_conf_defaults(), group), **values)


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
    `group_from_dict` restores them as None.
    """
    return {g: drop_none(OmegaConf.to_container(cfg[g], resolve=True, enum_to_str=True)) for g in GROUPS}


def as_plain_dict(group) -> dict:
    """A typed group as JSON-able values (enums by value): for specs, manifests and hashes."""
    return json.loads(json.dumps(dataclasses.asdict(group), default=lambda v: getattr(v, "value", str(v))))


def drop_none(d: dict) -> dict:
    """Without its None values, recursively, in lists too (KFP parameters cannot hold None)."""

    def clean(v):
        return drop_none(v) if isinstance(v, dict) else [clean(x) for x in v] if isinstance(v, list) else v

    return {k: clean(v) for k, v in d.items() if v is not None}
