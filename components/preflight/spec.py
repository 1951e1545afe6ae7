"""What the preflight stage tells its workers."""

from __future__ import annotations

from dataclasses import dataclass

from components.config import ModelConfig, PreflightConfig, StoreConfig, TrainConfig
from components.worker_side import WorkerSpec


@dataclass(frozen=True)
class PreflightSpec(WorkerSpec):
    preflight: PreflightConfig
    store: StoreConfig  # as the replicas reach it (launcher.replica_store)
    dataset: str | None  # dataset/NAME@VERSION whose read preflight times
    name: str  # the fleet's name: preflight/<name>@<run_id> holds every process's numbers
    run_id: str
    checkpoint_dir: str  # the disk checkpoints land on, inside the replica
    dtype: str = "float32"  # the training precision's compute dtype: the numerics battery's
    # the run's model and training config: the shape of the step whose host time preflight measures
    model: ModelConfig | None = None
    train: TrainConfig | None = None
