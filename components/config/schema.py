"""The schema: structured-config dataclasses that Hydra validates `conf/` against.

Every default lives in `conf/*.yaml`: each field here is `MISSING`, so a key that `conf/`
does not set fails at compose time. Types are checked by OmegaConf when Hydra composes; what
values can work is `rules.py`'s, which each group's `check()` asks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from components.config import rules


class Precision(str, Enum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp8 = "fp8"


class Fp8Recipe(str, Enum):
    tensorwise = "tensorwise"
    rowwise = "rowwise"
    rowwise_with_gw_hp = "rowwise_with_gw_hp"


class ActivationCheckpointing(str, Enum):
    """What a block keeps for backward: everything (off); only its input, the whole block
    recomputed (full, every `ac_every_n_blocks`-th block); or some op outputs, per
    components/parallel/checkpointing.py's rule (selective, every block). True where it is on."""

    off = "off"
    selective = "selective"
    full = "full"

    def __bool__(self) -> bool:
        return self is not ActivationCheckpointing.off


class Parallelism(str, Enum):
    ddp = "ddp"
    fsdp = "fsdp"


class Guard(str, Enum):
    """What a run-time finding (a loss spike, a non-finite step) does: nothing is looked at (off),
    recorded (log), the step's update dropped (skip), dropped and after too many in a row the
    run rewinds to a checkpoint (rollback), or the stage fails (halt)."""

    off = "off"
    log = "log"
    skip = "skip"
    rollback = "rollback"
    halt = "halt"


class Scheduler(str, Enum):
    local_cwd = "local_cwd"
    kubernetes = "kubernetes"


class StoreBackend(str, Enum):
    local = "local"
    minio = "minio"


@dataclass
class SourceConfig:
    """One named source of a mixture: what it changes of the data group's source keys (a key
    left None is the data group's). Each source is tokenized into a dataset version of its own."""

    paths: list[str] | None = None
    hub_name: str | None = None
    hub_config: str | None = None
    hub_split: str | None = None
    hub_revision: str | None = None
    text_field: str | None = None
    min_chars: int | None = None
    max_doc_bytes: int | None = None
    dedup: bool | None = None
    val_fraction: float | None = None
    shards: int | None = None
    max_epochs: float | None = None  # at most this many passes over its train blocks; None: no cap


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
    sources: dict[str, SourceConfig] = MISSING  # {}: one source, the keys above; else named sources
    mixture: dict[str, float] = MISSING  # a weight per source (normalised), chosen at train time

    def check(self, model: ModelConfig | None = None) -> list[str]:
        return rules.data_rules(self, model=model)

    @property
    def source_names(self) -> list[str]:
        """The sources in a fixed order: the named ones sorted, or the one the group's keys name."""
        return sorted(self.sources) if self.sources else [self.name]

    def source(self, name: str) -> DataConfig:
        """One source as a whole data group of its own (its name, its keys over the group's)."""
        import dataclasses

        if not self.sources and name == self.name:
            return self
        mine = {k: v for k, v in dataclasses.asdict(self.sources[name]).items() if v is not None}
        mine.pop("max_epochs", None)
        return dataclasses.replace(self, name=name, sources={}, mixture={}, **mine)

    def weights(self, train_blocks: dict[str, int]) -> dict[str, float]:
        """Each source's share of the samples, normalised: data.mixture's, or by default the
        sources' own sizes (`train_blocks`), as concatenating them would give."""
        raw = {s: float(self.mixture.get(s, 0.0)) for s in self.source_names} if self.mixture else train_blocks
        total = sum(raw.values())
        return {s: raw[s] / total for s in self.source_names}


@dataclass
class TokenizerConfig:
    pretrained: str | None = MISSING  # hub name or local path; None trains a byte-level BPE
    revision: str | None = MISSING  # the hub repo's commit, required for a hub name
    vocab_size: int = MISSING  # for the trained BPE
    min_frequency: int = MISSING
    sample_mb: int = MISSING  # the BPE trains once, on the first sample_mb of training documents

    def check(self) -> list[str]:
        return rules.tokenizer_rules(self)


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
    family: str = MISSING  # components/models/FAMILIES: llama | moe
    # moe (a Mixtral-style mixture of experts): each block's MLP is num_experts expert MLPs of
    # ffn_hidden_size, each token routed to experts_per_token of them; the router's
    # load-balancing loss is added to the token loss times router_aux_loss_coef
    num_experts: int = MISSING
    experts_per_token: int = MISSING
    router_aux_loss_coef: float = MISSING

    def check(self) -> list[str]:
        return rules.model_rules(self)


@dataclass
class TrainConfig:
    precision: Precision = MISSING
    fp8_recipe: Fp8Recipe = MISSING
    activation_checkpointing: ActivationCheckpointing = MISSING  # off | selective | full
    ac_every_n_blocks: int = MISSING  # full: checkpoint every n-th transformer block
    compile: bool | None = MISSING  # torch.compile per block; None: on GPU, off on CPU
    parallelism: Parallelism = MISSING
    dp_replicate: int = MISSING  # HSDP (fsdp only): replicas of the FSDP shard groups; 1 = plain FSDP
    tp: int = MISSING  # tensor-parallel degree (ranks splitting each block's matmuls); 1 = none
    # under tp: norms and residual stream sharded along the sequence, the head's logits over the
    # vocabulary through a loss-parallel cross-entropy (components/parallel/dims.py: where it applies)
    sequence_parallel: bool = MISSING
    # under tp: each collective overlapped with the matmul beside it (inductor's micro-pipeline
    # pass over symmetric memory; compile and CUDA only): the planner hides tp's traffic under compute
    async_tp: bool = MISSING
    # the cross-entropy over chunks of this many tokens, each checkpointed: the fp32 logits and
    # their gradients exist a chunk at a time (components/models/token_loss); 0: all at once
    loss_chunk_tokens: int = MISSING
    pp: int = MISSING  # pipeline-parallel degree (ranks each holding a run of the blocks); 1 = none
    pp_schedule: str = MISSING  # how micro-batches flow through the stages: PIPELINE_SCHEDULES
    micro_batch_size: int = MISSING
    grad_accum_steps: int = MISSING
    # FSDP/HSDP: reduce-scatter after every micro-batch (sharded gradients accumulate); false:
    # only after the last, FSDP2 then holds unsharded fp32 gradients between them (less traffic).
    # Under pipeline parallelism the schedule syncs once a step whatever this says.
    fsdp_sync_every_microbatch: bool = MISSING
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
    # shard files record a sha256 per block this size: a resuming rank fetches and verifies only its blocks
    checkpoint_block_kib: int = MISSING
    resume: str = MISSING  # auto | never | <checkpoint version>
    run_dir: str = MISSING  # logs, metrics and exports, one subdirectory per training identity
    checkpoint_dir: str | None = MISSING  # None: <run_dir>/<identity>/checkpoints; shared storage in a cluster
    loss_scaling: bool = MISSING  # dynamic loss scaling (GradScaler); for fp16-range gradients
    log_interval: int = MISSING  # step lines every n steps: the settling steps, where the host reads values back
    val_interval: int = MISSING  # steps between val-loss measurements on fixed held-out blocks; 0 = off
    on_nonfinite: Guard = MISSING  # what a non-finite step does (rollback: after max_bad_steps in a row)
    max_bad_steps: int = MISSING  # consecutive non-finite steps before rolling back
    on_spike: Guard = MISSING  # what a loss spike does (rollback: rewind past its data window)
    loss_spike_factor: float = MISSING
    max_spikes: int = MISSING  # spiking steps in a row tolerated (skipped) before the rollback or halt
    sdc_interval: int = MISSING  # steps between weight fingerprints across data-parallel replicas; 0 = off
    straggler_interval: int = MISSING
    straggler_zscore: float = MISSING
    watchdog_timeout_s: float = MISSING
    peak_tflops: float | None = MISSING  # device peak for MFU; None: preflight's measure
    metrics_port: int = MISSING  # each node serves Prometheus metrics there (locally: + node index); 0 = off
    profile_poll_steps: int = MISSING  # steps between looks for a `liftoff profile` request in the store

    def check(self, cluster: ClusterConfig | None = None) -> list[str]:
        return rules.train_rules(self, cluster=cluster)


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
    memory_headroom: float = MISSING  # the allocator's share above what tensors hold (plan.reserved_gb)
    device_memory_gb: float | None = MISSING  # None: measured (GPU) or host memory (CPU)
    quarantine: bool = MISSING
    numerics_s: float = MISSING  # seconds of the numerics battery on every device (0: off)
    outliers: str | None = MISSING  # a node robust SDs below the rest: quarantine | warn; None: warn locally
    max_age_min: float | None = MISSING  # reuse the fleet's measurements this young; None: 60 locally, 0 on k8s

    def check(self, cluster: ClusterConfig | None = None) -> list[str]:
        return rules.preflight_rules(self, cluster=cluster)


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
    launch: str = MISSING  # auto | pod | replicas: where validate and evaluate load the model (sharded_model.py)

    def check(self) -> list[str]:
        return rules.eval_rules(self)


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
    spare_nodes: int = MISSING  # local_cwd: simulated nodes beyond `nodes` for excluded ones (Kubernetes: unused)
    quarantine_ttl_h: float = MISSING  # how long a finding keeps a node out of launches (0: none recorded)
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
        return rules.cluster_rules(self)


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
        return rules.store_rules(self)


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
        return rules.kfp_rules(self)


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


# the groups a pipeline carries as its parameters (kfp is where it is submitted, not one)
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
GROUPS = tuple(GROUP_SCHEMAS)

ConfigStore.instance().store(name="liftoff_schema", node=Config)
