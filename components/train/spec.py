"""What the train stage tells its workers (`TrainSpec`) and what rank 0 hands back through
the store (`WorkerResult`): the two typed messages across the pod boundary."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from components.config import ModelConfig, StoreConfig, TrainConfig
from components.worker_side import WorkerSpec


@dataclass(frozen=True)
class TrainSpec(WorkerSpec):
    train: TrainConfig
    model: ModelConfig
    store: StoreConfig  # as the replicas reach it (launcher.replica_store)
    dataset: str  # dataset/NAME@VERSION
    data_cache_gb: float  # data.cache_gb: the node's bound on the shards it keeps
    identity: str  # the training identity: what determines the weights' math
    launch_id: str  # names this launch's run record in the store
    run_dir: str  # inside the replica, relative to its own working directory
    checkpoint_dir: str  # likewise; each node keeps its own checkpoints under it
    nodes_share_host: bool = False  # local_cwd: every "node" on this host (metrics ports differ per node)
    quarantine_ttl_s: float = 0.0  # a straggler's node is quarantined this long (cluster.quarantine_ttl_h; 0: not)
    trains_no_step: bool = False  # preflight skipped (the store held it at train.steps): only re-export
    mixture: dict = dataclasses.field(default_factory=dict)  # {source: normalised weight}; {} for one source
    max_epochs: dict = dataclasses.field(default_factory=dict)  # {source: cap on passes} of the capped sources


@dataclass(frozen=True)
class WorkerResult:
    """What trained, read from the live model, and how it ended."""

    final_loss: float
    probe_loss: float | None  # loss on the first val blocks as the model trained; validate re-checks it
    probe_blocks: int
    steps: int
    skipped_steps: int
    checkpoint: str  # the final checkpoint's directory name, step-N
    checkpoint_version: str
    publish_errors: list[str]
    world: int
    precision: str
    float8_linear_count: int
    float8_linear_modules: list[str]
    wrapped_modules: dict[str, int]
    float8_cast_configs: list[str]
    forward_dtypes: dict[str, str]
    resumed_from: str | None = None  # checkpoint/NAME@VERSION this launch continued; None: fresh
    start_step: int = 0  # the step it continued from; steps - start_step were trained here
    model: str = ""  # model/NAME@VERSION, once published
    skipped_samples: list = dataclasses.field(default_factory=list)  # [start, end) global samples never trained on
    nodes: list = dataclasses.field(default_factory=list)  # the node each rank ran on (NODE_NAME), by rank
    drawn: dict = dataclasses.field(default_factory=dict)  # a mixture's samples per source over the whole run

    @property
    def continued(self) -> str:
        """How this launch started, as the run summary, the sweep table and the eval report say it."""
        if self.resumed_from is None:
            return "fresh"
        trained = self.steps - self.start_step
        return f"resumed from {self.resumed_from} at step {self.start_step}" + (
            f", trained {trained} step(s)" if trained else ", trained no step"
        )

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> WorkerResult:
        return cls(**data)
