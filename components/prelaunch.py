"""Checks on the train stage's inputs, run before anything is launched."""

from __future__ import annotations

from dataclasses import asdict

from components.config import ClusterConfig, DataConfig, ModelConfig, TrainConfig
from components.parallel import ParallelDims
from components.precision import recipe
from components.store import ArtifactStore, Manifest, Ref
from components.stream import shard_table


class TrainInputError(ValueError):
    pass


class DataFitError(TrainInputError):
    pass


class ResumeError(TrainInputError):
    pass


def check_shape(meta: dict, model: ModelConfig, where: str) -> None:
    """A checkpoint's recorded model shape must equal this run's."""
    theirs = {k: v for k, v in meta.get("model", {}).items() if k != "name"}
    ours = {k: v for k, v in asdict(model).items() if v is not None and k != "name"}
    diff = {k: (theirs.get(k), v) for k, v in ours.items() if theirs.get(k) != v}
    if diff:
        raise ResumeError(
            f"{where} was trained with another model shape: "
            + ", ".join(f"{k}={a} there vs {b} here" for k, (a, b) in sorted(diff.items()))
        )


def blocks_per_step(train: TrainConfig, cluster: ClusterConfig) -> tuple[int, int]:
    """(data-parallel world, blocks one optimizer step reads): data-parallel ranks read distinct blocks."""
    dp = ParallelDims.of(train, cluster.nodes * cluster.procs_per_node).dp
    return dp, train.micro_batch_size * train.grad_accum_steps * dp


def check_inputs(
    dataset: Manifest,
    model: ModelConfig,
    train: TrainConfig,
    cluster: ClusterConfig,
    store: ArtifactStore,
    cache_gb: float,
    data: DataConfig | None = None,
) -> None:
    """Everything that would fail training, checked before anything is launched, from the
    dataset's manifest alone (its stats and shard list): the driver downloads no data. With
    `data`, a mixture's weights too: each weighed source can feed its share of the run."""
    stats = dataset.metadata.get("stats", {})
    table = shard_table(dataset, "train")
    largest, reading = max(s["bytes"] for s in table), len({s["source"] for s in table})
    keep = 2 if reading == 1 else 2 * reading + 1  # a mixture keeps 2 per source open (BlockSampler)
    if cache_gb * 2**30 < keep * largest:
        what = "two" if reading == 1 else f"{keep}"
        per = "the shard it reads" if reading == 1 else f"the last two shards it read of each of the {reading} sources"
        raise DataFitError(
            f"data.cache_gb={cache_gb} holds fewer than {what} of {dataset.ref}'s train shards (the largest is "
            f"{largest / 2**20:.1f} MiB): each node keeps {per} and the next one; raise data.cache_gb"
        )
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
    world, per_step = blocks_per_step(train, cluster)
    n_blocks = stats["splits"]["train"]["blocks"]
    if n_blocks < per_step:
        raise DataFitError(
            f"train.micro_batch_size={train.micro_batch_size} x train.grad_accum_steps="
            f"{train.grad_accum_steps} x data-parallel world {world} = {per_step} blocks per step, but the "
            f"train split has only {n_blocks} blocks"
        )
    if data is not None:
        from components.mixture import check_mixture_feeds, check_seed_mixture  # it imports this module

        check_mixture_feeds(data, dataset, train.steps * per_step)
    recipe(train.precision).check_model(model)
    if train.resume not in ("auto", "never"):
        ref = Ref("checkpoint", model.name, train.resume)
        if not store.exists(ref):
            if (record := store.quarantined(ref)) is not None:  # damaged bytes: refused, never resumed
                raise ResumeError(f"train.resume={train.resume}: {ref} is quarantined: {record.get('reason', '')}")
            raise ResumeError(f"train.resume={train.resume}: no {ref} in {store.description}")
        seed = store.manifest(ref).metadata
        check_shape(seed, model, f"train.resume={train.resume}")
        if data is not None:
            check_seed_mixture(seed, data, dataset, f"train.resume={train.resume}")
        if isinstance(seed.get("step"), int) and seed["step"] >= train.steps:
            raise ResumeError(
                f"train.resume={train.resume} is at step {seed['step']}, nothing left to train with "
                f"train.steps={train.steps}: continuing a run means more steps than it has"
            )
