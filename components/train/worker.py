"""The training process torchrun starts on every rank: `python -m components.train.worker --spec-b64 ...`.

`main` reads top to bottom: set up the job -> resume -> for each step: `train_step`, log,
`checkpoint_or_rollback` -> `finish` (export, result). `train_step` is the whole step on one
screen: micro-batches forward/backward, all ranks agree on the loss, then clip and step
(or skip a non-finite step).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import math
import os
import shutil
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record

from components import checkpoint_format
from components.config import ModelConfig, TrainConfig, as_plain_dict, drop_none
from components.distributed import init_distributed
from components.launcher import PLUGIN_ENV, worker_spec
from components.model_math import flops_per_token
from components.precision import Recipe, recipe
from components.precision.fp8 import float8_cast_configs, float8_modules
from components.store import ArtifactStore, Ref, open_store, sha256_file
from components.stream import StreamingBlocks, open_split
from components.train import checkpoint as ckpt
from components.train.activation_checkpoint import apply_activation_checkpointing
from components.train.data import BlockSampler
from components.train.export import export_hf
from components.train.model import build_model, count_params
from components.train.monitor import DeviceTimer, Monitor, StepLine, Watchdog, device_peak_tflops, peak_memory_bytes
from components.train.nonfinite import clean_name, first_nonfinite_module
from components.train.optim import build_optimizer, clip_and_step, lr_at, set_lr
from components.train.parallel import apply_compile, gradient_sync, wrap
from components.train.profiler import Profiler
from components.train.prometheus import exporter_for
from components.train.resume import Resumed, find_resume_checkpoint
from components.train.spec import TrainSpec, WorkerResult

log = logging.getLogger("liftoff.train")


@dataclass
class TrainState:
    """What a checkpoint carries forward besides weights and optimizer state."""

    step: int = 0
    samples: int = 0  # global samples consumed: the data order continues from here, on any world size
    skipped: int = 0
    bad_in_row: int = 0
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
    on_step: list = field(default_factory=list)  # callables(step), run as each step starts
    forward_dtypes: dict = field(default_factory=dict)  # dtypes seen inside a forward (mixed precision's effect)

    @property
    def ckpt_root(self) -> Path:
        return checkpoint_root(self.spec)

    @property
    def identity(self) -> str:
        return self.spec.identity


def build_job(spec: TrainSpec) -> Job:
    """Data, model (fp8 convert -> activation checkpointing -> compile -> FSDP/DDP, as
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
    sampler = BlockSampler(blocks, train.micro_batch_size, train.grad_accum_steps, world, rank, train.seed)
    model = build_model(model_cfg, model_cfg.vocab_size or vocab, train.seed).to(device)
    seq_len = blocks.block_len - 1
    n_flops = flops_per_token(model_cfg, count_params(model, exclude_embeddings=True), seq_len)
    precision.apply(model, train, device)
    if train.activation_checkpointing:
        apply_activation_checkpointing(model, train.ac_every_n_blocks)
    compiled = train.compile if train.compile is not None else device.type == "cuda"
    if compiled:
        apply_compile(model)
    model = wrap(model, train.parallelism, device, precision)
    fsdp = hasattr(model, "set_requires_gradient_sync")
    if fsdp:
        precision.after_optimizer_step(model, train, fsdp)  # the first step's fp8 all-gather scales
    optimizer = build_optimizer(model, train)
    scaler = torch.amp.GradScaler(device.type) if train.loss_scaling else None

    checkpointer = build_checkpointer(spec, train, store, model_cfg.name, rank)
    node = os.environ.get("NODE_NAME") or socket.gethostname()
    exporter = exporter_for(train.metrics_port, spec.identity, rank, node, spec.launch_id, spec.nodes_share_host)
    monitor = Monitor(
        Path(spec.run_dir),
        rank,
        world,
        train.loss_spike_factor,
        train.straggler_zscore,
        train.log_interval,
        device,
        exporter,
    )
    float8 = [clean_name(n) for n in float8_modules(model)]  # read from the model that trains
    return Job(
        spec=spec,
        train=train,
        model_cfg=model_cfg,
        store=store,
        rank=rank,
        world=world,
        device=device,
        recipe=precision,
        fsdp=fsdp,
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
        tokens_per_step=train.micro_batch_size * train.grad_accum_steps * world * seq_len,
        flops_per_token=n_flops,
        float8_modules=float8,
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
    return ckpt.Checkpointer(checkpoint_root(spec), train.checkpoint_keep, train.checkpoint_async, rank, target)


def resume(job: Job, state: TrainState) -> Resumed | None:
    """Load the checkpoint `train.resume` chooses among the store's versions into the job."""
    found = find_resume_checkpoint(
        job.train.resume, job.ckpt_root, job.store, job.model_cfg, job.identity, job.rank, job.train.steps
    )
    if found is None:
        return None
    loaded = ckpt.load(found.path, job.model, job.optimizer, job.rank)
    meta = loaded["meta"]
    # the history up to the checkpoint: this run's own, or a seed's (the steps this model went through)
    job.monitor.restore_history(found.path / checkpoint_format.HISTORY)
    state.step, state.samples, state.skipped = meta["step"], meta["samples"], meta.get("skipped_steps", 0)
    if "rng" in loaded["rank_state"]:
        torch.set_rng_state(loaded["rank_state"]["rng"])
    if job.scaler is not None and "scaler_scale" in meta:
        job.scaler.load_state_dict({**job.scaler.state_dict(), "scale": meta["scaler_scale"]})
    job.recipe.after_optimizer_step(job.model, job.train, job.fsdp)  # scales of the loaded weights
    log.info("resumed from %s at step %d (global sample %d)", found.ref, state.step, state.samples)
    return found


def micro_loss(job: Job, batch: torch.Tensor) -> torch.Tensor:
    with job.recipe.autocast(job.device, job.fsdp):
        logits = job.model(input_ids=batch[:, :-1]).logits
    return F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())


def train_step(job: Job, state: TrainState) -> dict:
    """One optimizer step. The only host<->device syncs: the loss_and_pending loss and the grad norm."""
    t0 = time.perf_counter()
    accum, forward, data_s = job.train.grad_accum_steps, DeviceTimer(job.device), 0.0
    loss_sum = torch.zeros((), device=job.device)
    first_batch = None  # replayed to name the culprit module if the step turns out non-finite
    for micro in range(accum):
        t_data = time.perf_counter()
        batch = job.sampler.batch(state.samples, job.device)
        data_s += time.perf_counter() - t_data
        first_batch = batch if first_batch is None else first_batch
        state.samples += job.sampler.samples_per_micro_batch
        with gradient_sync(job.model, micro == accum - 1):
            with forward:
                loss = micro_loss(job, batch) / accum
            (job.scaler.scale(loss) if job.scaler is not None else loss).backward()
        loss_sum += loss.detach()

    # all ranks agree on the loss and on whether every rank's async checkpoint is on disk
    t_comm = time.perf_counter()
    pending = 0.0 if job.checkpointer.pending_done() else 1.0
    loss_and_pending = torch.stack([loss_sum, torch.full((), pending, device=job.device)])  # filled on the device
    dist.all_reduce(loss_and_pending)
    loss_total, pending_ranks = loss_and_pending.tolist()
    comm_s = time.perf_counter() - t_comm
    step_loss = loss_total / job.world

    t_opt = time.perf_counter()
    set_lr(job.optimizer, lr_at(state.step - 1, job.train))
    if math.isfinite(step_loss):  # every rank has the same all-reduced loss, so all take one branch
        grad_norm, stepped = clip_and_step(job.model, job.optimizer, job.train.grad_clip, job.scaler)
        job.recipe.after_optimizer_step(job.model, job.train, job.fsdp)
    else:  # a non-finite loss never reaches the optimizer, whatever the gradients look like
        job.optimizer.zero_grad(set_to_none=True)
        if job.scaler is not None:
            job.scaler.update(job.scaler.get_scale() * job.scaler.get_backoff_factor())
        grad_norm, stepped = math.nan, False
    opt_s = time.perf_counter() - t_opt
    if stepped:
        state.bad_in_row, state.last_loss = 0, step_loss
    else:
        state.skipped += 1
        state.bad_in_row += 1
        culprit = first_nonfinite_module(job.model, lambda b=first_batch: micro_loss(job, b))
        job.monitor.event(
            "nonfinite_step",
            step=state.step,
            loss=step_loss,
            grad_norm=grad_norm,
            skipped_total=state.skipped,
            first_nonfinite_module=culprit,
        )
    step_s = time.perf_counter() - t0
    return {
        "step": state.step,
        "loss": step_loss,
        "grad_norm": grad_norm,
        "lr": job.optimizer.param_groups[0]["lr"],
        "stepped": stepped,
        "skipped_steps": state.skipped,
        "tokens_per_s": job.tokens_per_step / step_s,
        "step_s": step_s,
        "data_s": data_s,
        "fwd_bwd_s": step_s - comm_s - opt_s - data_s,
        "optimizer_s": opt_s,
        "comm_s": comm_s,
        "forward_s": forward.seconds(),
        "peak_memory_bytes": peak_memory_bytes(job.device),
        "checkpoint_pending_ranks": pending_ranks,
        "time": time.time(),
    }


def checkpoint_or_rollback(job: Job, state: TrainState, record: dict) -> None:
    """Publish an async checkpoint every rank has finished; roll back after too many
    non-finite steps in a row; save on the interval and at the last step."""
    if job.checkpointer.has_pending and record["checkpoint_pending_ranks"] == 0:
        job.checkpointer.finish_pending()  # on disk everywhere: seal and publish it
    if state.bad_in_row >= job.train.max_bad_steps:
        job.checkpointer.wait()
        # the same choice as resume: the newest stored checkpoint that verifies (own first, then a seed)
        mode = "auto" if job.train.resume == "never" else job.train.resume
        root, identity = job.ckpt_root, job.identity
        target = find_resume_checkpoint(mode, root, job.store, job.model_cfg, identity, job.rank, state.step)
        if target is None:
            raise RuntimeError(
                f"{state.bad_in_row} non-finite steps in a row (train.max_bad_steps="
                f"{job.train.max_bad_steps}) and no checkpoint to roll back to"
            )
        ckpt.load(target.path, job.model, job.optimizer, job.rank)
        job.recipe.after_optimizer_step(job.model, job.train, job.fsdp)
        job.monitor.event("rollback", step=state.step, to=str(target.ref), data_samples_kept=state.samples)
        state.bad_in_row = 0
    if state.step % job.train.checkpoint_interval == 0 or state.step == job.train.steps:
        meta = {
            "step": state.step,
            "samples": state.samples,
            "loss": state.last_loss,
            "skipped_steps": state.skipped,
            "identity": job.identity,
            "model": drop_none(as_plain_dict(job.model_cfg)),
            "world": job.world,
            "dataset": job.spec.dataset,
        }
        if job.scaler is not None:
            meta["scaler_scale"] = job.scaler.get_scale()
        rng = {"rng": torch.get_rng_state()}
        job.checkpointer.save(state.step, job.model, job.optimizer, meta, rng, job.monitor.history)


VAL_BLOCKS = 32  # periodic validation's fixed held-out set: the val split's first blocks


def validates_at(step: int, interval: int, last_step: int) -> bool:
    """Whether periodic validation runs after this step: every `interval` steps (train.val_interval)
    and at the last step; never with 0."""
    return interval > 0 and (step % interval == 0 or step == last_step)


def val_loss(job: Job) -> tuple[float, int] | None:
    """(mean token loss, blocks) of the model as it trains on the first VAL_BLOCKS val blocks, in
    micro batches: the same blocks every time, so the curve compares like with like. Every rank
    runs it (a collective under FSDP), without gradients; compiled blocks run eagerly."""
    from components.blocks import batches

    n = min(VAL_BLOCKS, len(job.val))
    if n == 0:
        return None
    total = 0.0
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        for batch in batches(job.val, n, job.train.micro_batch_size):
            total += float(micro_loss(job, batch.to(job.device))) * len(batch)  # blocks of one length: a token mean
    return total / n, n


def validate(job: Job, step: int) -> None:
    t0 = time.perf_counter()
    measured = val_loss(job)
    if measured is not None:
        job.monitor.log_val(step, *measured, time.perf_counter() - t0)


PROBE_BLOCKS = 8


def probe_loss(job: Job) -> float | None:
    """The trained model's loss as it trained (its wrappers and precision) on the first val
    blocks; validate recomputes it from the stored export, in fp32, in another process. A
    collective under FSDP: every rank runs it. Compiled blocks run eagerly (no recompile)."""
    import numpy as np

    val = job.val
    n = min(PROBE_BLOCKS, len(val))
    if n == 0:
        return None
    batch = torch.from_numpy(np.stack([val[i] for i in range(n)]).astype(np.int64)).to(job.device)
    norm = next(m for name, m in job.model.named_modules() if name.endswith("input_layernorm"))

    def record(module, args) -> None:  # returns None: the forward's inputs stay as they are
        job.forward_dtypes.setdefault("norm_weight", str(module.weight.dtype))

    seen = norm.register_forward_pre_hook(record)
    try:
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            return float(micro_loss(job, batch))
    finally:
        seen.remove()


def finish(job: Job, state: TrainState, resumed: Resumed | None) -> WorkerResult | None:
    """Wait for the last checkpoint, export the model, write the run's result (rank 0)."""
    job.checkpointer.wait()
    probe = probe_loss(job)
    export_dir = Path(job.spec.run_dir) / "export"
    export_hf(
        job.model,
        job.model_cfg,
        job.model_cfg.vocab_size or job.vocab,
        job.data_dir / "tokenizer",
        export_dir,
        job.rank,
    )
    job.watchdog.stop()
    if job.rank != 0:
        return None
    final = job.ckpt_root / f"step-{state.step}"  # the last step trains and saves; a resume at it loaded it
    return WorkerResult(
        final_loss=state.last_loss,
        probe_loss=probe,
        probe_blocks=PROBE_BLOCKS,
        steps=job.train.steps,
        skipped_steps=state.skipped,
        checkpoint=final.name,
        checkpoint_version=checkpoint_format.version_of(job.identity, final),
        publish_errors=job.checkpointer.publish_errors,
        world=job.world,
        precision=job.train.precision.value,
        float8_linear_count=len(job.float8_modules),
        float8_linear_modules=job.float8_modules,
        wrapped_modules=wrapped_modules(job.model),
        float8_cast_configs=float8_cast_configs(job.model),
        forward_dtypes=job.forward_dtypes,  # e.g. a block norm's weight as the forward saw it
        resumed_from=str(resumed.ref) if resumed else None,
        start_step=resumed.step if resumed else 0,
    )


def describe(job: Job) -> str:
    """What trains, read from the live model: world, precision, wrappers."""
    wrapped = wrapped_modules(job.model)
    blocks = job.model_cfg.num_layers
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    parts = [f"training on {nodes} node(s) x {job.world // nodes} process(es), {job.device.type}"]
    if job.float8_modules:
        parts.append(f"fp8 ({job.train.fp8_recipe.value}) in {len(job.float8_modules)} Float8Linear, bf16 elsewhere")
    else:
        parts.append(job.train.precision.value)
    parts.append(f"activation checkpointing on {wrapped['activation_checkpoint']}/{blocks} blocks")
    parts.append(f"compiled {wrapped['compiled']}/{blocks} blocks")
    parts.append("FSDP2" if wrapped["fsdp"] else ("DDP" if job.world > 1 else "one process"))
    return ", ".join(parts)


def wrapped_modules(model: torch.nn.Module) -> dict[str, int]:
    """How many modules of the trained model each wrapper holds, counted by type."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.fsdp import FSDPModule
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    kinds = {"fsdp": FSDPModule, "activation_checkpoint": CheckpointWrapper, "compiled": torch._dynamo.OptimizedModule}
    counts = {name: sum(isinstance(m, cls) for m in model.modules()) for name, cls in kinds.items()}
    # parameters FSDP all-gathers in fp8: their local shard is torchao's float8-cast weight
    local = [getattr(p, "_local_tensor", p) for p in model.parameters()]
    counts["fp8_all_gather_params"] = sum(isinstance(t, WeightWithDynamicFloat8CastTensor) for t in local)
    # scales precomputed for the next all-gather, one all-reduce for all weights (torchao's FSDP recipe)
    counts["fp8_precomputed_scales"] = sum(getattr(t, "_precomputed_scale", None) is not None for t in local)
    return counts


def install_plugin(job: Job, state: TrainState) -> None:
    name = os.environ.get(PLUGIN_ENV)
    if name:
        importlib.import_module(name).install(job, state)


@record
def main(argv: list[str] | None = None) -> int:
    job = build_job(worker_spec(argv, TrainSpec))
    state = TrainState()
    install_plugin(job, state)
    profiler = Profiler(job.store, job.identity, job.model_cfg.name, job.spec.dataset, job.rank,
                        job.train.profile_poll_steps, job.device)  # fmt: skip
    job.on_step.append(profiler.on_step)  # `liftoff profile`: a request in the store, looked for every few steps
    resumed_from = resume(job, state)
    if job.rank == 0:
        job.monitor.event(
            "start",
            world=job.world,
            step=state.step,
            resumed_from=str(resumed_from.ref) if resumed_from else None,
            params=count_params(job.model),
            flops_per_token=job.flops_per_token,
            precision=job.train.precision.value,
            float8_linear_count=len(job.float8_modules),
            float8_linear_modules=job.float8_modules,
        )
    peak = job.train.peak_tflops or device_peak_tflops(job.device)
    line = StepLine(job.train.steps, job.train.log_interval, job.flops_per_token, peak, job.world, job.device)
    if job.rank == 0:
        log.info(describe(job))
        if job.device.type != "cuda" and job.float8_modules:
            log.info("fp8 on CPU is emulated: it checks the numerics, its speed means nothing")
    for step in range(state.step + 1, job.train.steps + 1):
        state.step = step
        job.watchdog.beat()
        for hook in job.on_step:
            hook(step)
        record = train_step(job, state)
        record["mfu"] = line.mfu(record["tokens_per_s"])
        record.update(job.checkpointer.seconds)
        job.monitor.log_step(record)
        if job.rank == 0 and (text := line.add(record)):
            log.info(text)
        if step % job.train.straggler_interval == 0:
            job.monitor.check_stragglers(step)
        if validates_at(step, job.train.val_interval, job.train.steps):
            validate(job, step)
        checkpoint_or_rollback(job, state, record)
    profiler.close(state.step)
    result = finish(job, state, resumed_from)
    job.sampler.blocks.close()  # no prefetch left running
    job.val.close()
    if result is not None:
        job.monitor.event("end", **result.to_json())
    job.monitor.close()
    if result is not None:
        hand_back(job, result)
    dist.barrier()  # every rank is done with the store torchrun's agent serves: a quiet teardown
    dist.destroy_process_group()
    return 0


def hand_back(job: Job, result: WorkerResult) -> None:
    """Rank 0 returns everything through the store, the one thing a driver pod shares with
    the replicas: the model (Hugging Face export plus the training records), then the run's
    record (`run/<identity>@<launch id>`: the result and metrics.jsonl) naming it. The model
    carries the training records and the TensorBoard events, so they outlive the pods."""
    run_dir, export = Path(job.spec.run_dir), Path(job.spec.run_dir) / "export"
    shutil.copyfile(run_dir / "metrics.jsonl", export / "training_metrics.jsonl")
    if (run_dir / "tensorboard").is_dir():  # the run's one event file (train/ and val/ scalars)
        shutil.copytree(run_dir / "tensorboard", export / "tensorboard", dirs_exist_ok=True)
    # the version names the weights too: a rerun that trains other weights (a code change,
    # train.resume=never) publishes a new version instead of handing back the stored one
    digest = sha256_file(export / "model.safetensors")[:12]
    heal_lineage(job.store, Ref("model", job.model_cfg.name, f"{job.identity}-{digest}"))
    keys = ("final_loss", "probe_loss", "probe_blocks", "steps", "precision", "float8_linear_count",
            "float8_linear_modules", "float8_cast_configs", "world", "wrapped_modules", "resumed_from",
            "start_step")  # fmt: skip
    model = job.store.publish(
        "model",
        job.model_cfg.name,
        f"{job.identity}-{digest}",
        export,
        metadata={
            **{k: getattr(result, k) for k in keys},
            "continued": result.continued,
            "identity": job.identity,
            "train": as_plain_dict(job.train),
        },
        parents=[job.spec.dataset, f"checkpoint/{job.model_cfg.name}@{result.checkpoint_version}"],
    )
    with tempfile.TemporaryDirectory() as staging:  # the record exists only in the store
        record = Path(staging)
        handed = dataclasses.replace(result, model=str(model.ref))
        (record / "result.json").write_text(json.dumps(handed.to_json(), indent=2))
        shutil.copyfile(run_dir / "metrics.jsonl", record / "metrics.jsonl")
        job.store.publish("run", job.identity, job.spec.launch_id, record, parents=[str(model.ref)])


def heal_lineage(store: ArtifactStore, ref: Ref) -> None:
    """A stored version of these same weights whose parents are gone, quarantined or damaged (a
    checkpoint this run trained again) is quarantined, so the publish after this names parents
    that verify instead of handing back the stored version with its dead lineage."""
    if not store.exists(ref):
        return
    parents = [Ref.parse(p) for p in store.manifest(ref).parents]
    # a checkpoint parent is re-hashed (and quarantined if it does not verify): a dataset is not
    dead = [str(p) for p in parents if not store.exists(p) or (p.kind == "checkpoint" and store.check(p))]
    if dead:
        store.quarantine(ref, f"its lineage names {', '.join(dead)}, gone or damaged")


if __name__ == "__main__":
    sys.exit(main())
