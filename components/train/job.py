"""A training job: what every rank sets up before its first step (model, precision, wrappers,
data, optimizer, checkpointer, monitor), the state the loop carries, and one micro-batch's loss."""

from __future__ import annotations

import dataclasses
import math
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

import torch

from components.config import ModelConfig, TrainConfig
from components.distributed import init_distributed
from components.model_math import planned_flops_per_token
from components.models import attend_causally, build_model, spec_of, token_loss
from components.optimizer import build_optimizer
from components.parallel import ParallelDims
from components.parallel.apply import parallelize
from components.parallel.pipeline import Pipeline
from components.parallel.tensor import local_loss, loss_scope
from components.precision import Recipe, recipe
from components.store import ArtifactStore, Ref, open_store
from components.stream import StreamingBlocks, open_split
from components.train import checkpoint as ckpt
from components.train.collectives import Tracker, hand_back_hang
from components.train.data import BlockSampler, Mixture
from components.train.grad_norms import LocalGradNorms
from components.train.guards import Guards
from components.train.monitor import Monitor, Watchdog
from components.train.nonfinite import clean_name
from components.train.prometheus import exporter_for
from components.train.spec import TrainSpec
from components.worker_side import REPORT_CONTEXT


@dataclass
class TrainState:
    """What a checkpoint carries forward besides weights and optimizer state."""

    step: int = 0
    samples: int = 0  # global samples consumed: the data order continues from here, on any world size
    skipped: int = 0
    bad_in_row: int = 0  # non-finite steps in a row
    spikes_in_row: int = 0
    spike_from: tuple[int, int] = (0, 0)  # (step, global sample) where the row of spikes began
    skip_windows: list = field(default_factory=list)  # [start, end) global samples a spike rollback skips
    sdc_suspect: dict | None = None  # a tie of replicas' fingerprints, replayed to its step to settle it
    spike_row: list = field(default_factory=list)  # (step, loss) of the spikes in the current row
    spike_rollback_from: int = 0  # the first spike step the last spike rollback rewound past
    last_loss: float = math.nan


@dataclass
class Job:
    """Everything set up once per process; the loop reads it."""

    spec: TrainSpec
    train: TrainConfig
    model_cfg: ModelConfig
    store: ArtifactStore
    rank: int
    world: int
    device: torch.device
    recipe: Recipe
    fsdp: bool
    dims: ParallelDims
    data_dir: Path  # the dataset version itself: tokenizer and stats (its blocks are in the shards)
    val: StreamingBlocks
    vocab: int
    sampler: BlockSampler
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    checkpointer: ckpt.Checkpointer
    monitor: Monitor
    watchdog: Watchdog
    tokens_per_step: int
    flops_per_token: float
    float8_modules: list[str]
    guards: Guards
    grad_norms: LocalGradNorms
    collectives: Tracker = field(default_factory=Tracker)  # liftoff's own collectives, counted (hangs)
    straggling: set = field(default_factory=set)  # the ranks the last straggler check flagged
    quarantined: set = field(default_factory=set)  # the nodes this run quarantined
    sdc_blamed: set = field(default_factory=set)  # the ranks an SDC check blamed in this launch
    sdc_reproduced: set = field(default_factory=set)  # steps whose gradient outlier reproduced on replay
    on_step: list = field(default_factory=list)  # callables(step), run as each step starts
    pipeline: Pipeline | None = None  # the schedule over this rank's stages, under train.pp > 1
    forward_dtypes: dict = field(default_factory=dict)  # dtypes seen inside a forward (mixed precision's effect)
    val_sources: dict | None = None  # a mixture's val split per source, opened at the first validation

    @property
    def ckpt_root(self) -> Path:
        return checkpoint_root(self.spec)

    @property
    def identity(self) -> str:
        return self.spec.identity


def build_job(spec: TrainSpec) -> Job:
    """Data, model (fp8 convert -> TP -> activation checkpointing -> compile -> FSDP/DDP, as
    torchtitan orders them), optimizer, checkpointer and monitor."""
    train, model_cfg = spec.train, spec.model
    store = open_store(spec.store)
    watchdog = Watchdog(train.watchdog_timeout_s)
    watchdog.start()
    rank, world, device = init_distributed(timeout_s=max(60.0, train.watchdog_timeout_s * 2))
    precision = recipe(train.precision)
    precision.check_device(device)
    dataset = store.manifest(Ref.parse(spec.dataset))
    blocks = open_split(store, dataset, "train", spec.data_cache_gb, on_wait=watchdog.beat)
    val = open_split(store, dataset, "val", spec.data_cache_gb, on_wait=watchdog.beat)
    vocab = dataset.metadata["stats"]["vocab_size"]
    data_dir = store.fetch(dataset)
    dims = ParallelDims.of(train, world)
    # tensor-parallel peers read the same samples: the sampler sees the data-parallel world
    dp, dp_rank = dims.dp, dims.dp_rank(rank)
    mix = Mixture.of(blocks, spec.mixture, spec.max_epochs) if spec.mixture else None  # a mixture's sources
    sampler = BlockSampler(blocks, train.micro_batch_size, train.grad_accum_steps, dp, dp_rank, train.seed, mix)
    model = build_model(model_cfg, model_cfg.vocab_size or vocab, train.seed).to(device)
    attend_causally(model)  # packed blocks: no mask, no host read per forward
    seq_len = blocks.block_len - 1
    n_flops = active_flops(model_cfg, vocab, seq_len)
    precision.apply(model, train, device)
    model = parallelize(model, train, dims, device, precision)  # TP -> AC -> compile -> FSDP/DDP
    fsdp = dims.fsdp  # what `parallelize` sharded
    if fsdp:
        precision.after_optimizer_step(model, train, fsdp)  # the first step's fp8 all-gather scales
    optimizer = build_optimizer(model, train)
    scaler = torch.amp.GradScaler(device.type) if train.loss_scaling else None

    checkpointer = build_checkpointer(spec, train, store, model_cfg.name, rank)
    node = os.environ.get("NODE_NAME") or socket.gethostname()
    exporter = exporter_for(
        train.metrics_port, spec.identity, rank, node, spec.launch_id, spec.nodes_share_host, train.steps
    )
    monitor = Monitor(
        Path(spec.run_dir),
        rank,
        world,
        train.straggler_zscore,
        train.log_interval,
        device,
        exporter,
    )
    float8 = [clean_name(n) for n in precision.describe(model, train)["float8_linear_modules"]]  # the live model
    tracker = Tracker()
    REPORT_CONTEXT.append(lambda: {"node": node, "collective": tracker.state()})  # in every failure report
    attempt = int(os.environ.get("LIFTOFF_ATTEMPT", "0"))
    watchdog.hand_back = lambda record: hand_back_hang(store, spec.launch_id, attempt, rank, record)
    return Job(
        collectives=tracker,
        spec=spec,
        train=train,
        model_cfg=model_cfg,
        store=store,
        rank=rank,
        world=world,
        device=device,
        recipe=precision,
        fsdp=fsdp,
        dims=dims,
        data_dir=data_dir,
        val=val,
        vocab=vocab,
        sampler=sampler,
        model=model,
        optimizer=optimizer,
        scaler=scaler,
        checkpointer=checkpointer,
        monitor=monitor,
        watchdog=watchdog,
        tokens_per_step=train.micro_batch_size * train.grad_accum_steps * dims.dp * seq_len,
        flops_per_token=n_flops,
        float8_modules=float8,
        guards=Guards(train, device),
        pipeline=Pipeline.of(model, train, device),
        grad_norms=LocalGradNorms(model if train.sdc_interval > 0 else None, world),
    )


def checkpoint_root(spec: TrainSpec) -> Path:
    """This node's checkpoint directory: relative paths land on the node's own disk; a volume
    mounted on every node gets one subdirectory per node, so no two nodes write one place."""
    return Path(spec.checkpoint_dir) / f"node{os.environ.get('GROUP_RANK', '0')}"


def build_checkpointer(spec: TrainSpec, train: TrainConfig, store: ArtifactStore, model_name: str, rank: int):
    """The checkpointer: every rank saves on its own node and uploads its own part; versions
    name the training identity, step and content."""
    seed = [] if train.resume in ("auto", "never") else [f"checkpoint/{model_name}@{train.resume}"]
    target = ckpt.StoreTarget(store, model_name, spec.identity, [spec.dataset, *seed])
    block = train.checkpoint_block_kib * 1024
    return ckpt.Checkpointer(checkpoint_root(spec), train.checkpoint_keep, train.checkpoint_async, rank, target, block)


def active_flops(model_cfg: ModelConfig, vocab: int, seq_len: int) -> float:
    """Training FLOPs per token (MFU's numerator): of a mixture of experts, its routed experts only."""
    sized = ModelConfig(**{**dataclasses.asdict(model_cfg), "vocab_size": model_cfg.vocab_size or vocab})
    return planned_flops_per_token(sized, seq_len)


def forward_loss(job: Job, batch: torch.Tensor, loads: list | None = None, aux: bool = True) -> torch.Tensor:
    """One micro-batch's loss, to backpropagate: the mean token loss plus the family's own term
    (a mixture of experts' router load-balancing loss), called inside `loss_scope(job.model)`
    (a loss-parallel head's is a replicated DTensor); `loads` collects the tokens each expert
    took; `aux=False`: the token loss alone (validation). Under pipeline parallelism forward
    only, through every stage: a collective of the pipeline's ranks."""
    if job.pipeline is not None:
        return job.pipeline.loss(batch)
    with job.recipe.autocast(job.device, job.fsdp):
        output = job.model(input_ids=batch[:, :-1])
    loss = token_loss(output.logits, batch[:, 1:], job.train.loss_chunk_tokens)
    family = spec_of(job.model)
    if aux and (term := family.aux_loss(job.model, output)) is not None:
        loss = loss + term
    if loads is not None and (load := family.expert_load(job.model, output)) is not None:
        loads.append(load)
    return loss


def micro_loss(job: Job, batch: torch.Tensor) -> torch.Tensor:
    """One micro-batch's mean token loss as a plain tensor, forward only (validation, replays)."""
    with loss_scope(job.model):
        return local_loss(forward_loss(job, batch, aux=False))
