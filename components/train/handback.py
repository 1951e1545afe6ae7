"""The end of a training: the probe loss as trained, the export, the result, what the run
says it trained (read from the live model), and the hand-back through the store."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from components import checkpoint_format
from components.config import as_plain_dict
from components.models import spec_of
from components.store import ArtifactStore, Ref, sha256_file
from components.store.lease import check_held_by_launch
from components.train.export import export_hf
from components.train.job import Job, TrainState, micro_loss
from components.train.resume import Resumed
from components.train.spec import WorkerResult

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
    norm = next(m for name, m in job.model.named_modules() if name.endswith(spec_of(job.model).probe_norm))

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
    float8 = pipeline_float8_modules(job)  # a collective: still watched
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
        float8_linear_count=len(float8),
        float8_linear_modules=float8,
        wrapped_modules=wrapped_modules(job.model),  # rank 0's: under PP, its stages
        float8_cast_configs=job.recipe.describe(job.model, job.train)["float8_cast_configs"],
        forward_dtypes=job.forward_dtypes,  # e.g. a block norm's weight as the forward saw it
        resumed_from=str(resumed.ref) if resumed else None,
        start_step=resumed.step if resumed else 0,
        skipped_samples=state.skip_windows,  # a spike rollback's data windows (components/train/guards.py)
        nodes=list(job.monitor.hosts),
        drawn=job.sampler.drawn(state.samples) if job.spec.mixture else {},
    )


def pipeline_float8_modules(job: Job) -> list[str]:
    """The model's Float8Linear modules: under pipeline parallelism each rank converted only its
    stages', so rank 0's pipeline group joins theirs (a collective of every rank), in forward order."""
    if job.pipeline is None:
        return job.float8_modules
    parts: list = [None] * dist.get_world_size(job.pipeline.group)
    dist.all_gather_object(parts, job.float8_modules, group=job.pipeline.group)
    spec = spec_of(job.model)
    return sorted({n for part in parts for n in part}, key=lambda n: (spec.forward_position(n), n))


def training_facts(job: Job) -> dict:
    """What trains, read from the live model: world, precision, wrappers (rank 0 logs them as
    its `training on` line and hands them to the driver as a `training` event)."""
    wrapped = wrapped_modules(job.model)
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    fp8 = bool(job.float8_modules)
    return {
        "nodes": nodes,
        "procs_per_node": job.world // nodes,
        "device": job.device.type,
        "precision": job.train.precision.value,
        "precision_said": job.recipe.describe(job.model, job.train)["said"],
        "fp8_recipe": job.train.fp8_recipe.value if fp8 else None,
        "float8_linear": len(job.float8_modules),
        "blocks": job.model_cfg.num_layers,
        "activation_checkpointed": wrapped["activation_checkpoint"],
        "checkpointing": job.train.activation_checkpointing.value,  # off | selective | full
        "compiled": wrapped["compiled"],
        "wrapper": ("FSDP2" if wrapped["fsdp"] else ("DDP" if job.dims.dp > 1 else "one process"))
        + (f" x TP={job.dims.tp}" if job.dims.tp > 1 else "")
        + (
            f" x PP={job.dims.pp} ({job.train.pp_schedule}, {wrapped['pp_stages']} stage(s) on rank 0)"
            if job.dims.pp > 1
            else ""
        ),
    }


def describe(f: dict) -> str:
    """The `training on` log line, from `training_facts`."""
    parts = [f"training on {f['nodes']} node(s) x {f['procs_per_node']} process(es), {f['device']}"]
    parts.append(f["precision_said"])
    checkpointed = f"{f['activation_checkpointed']}/{f['blocks']} blocks"
    parts.append(f"{f['checkpointing']} activation checkpointing on {checkpointed}")
    parts.append(f"compiled {f['compiled']}/{f['blocks']} blocks")
    parts.append(f["wrapper"])
    return ", ".join(parts)


def wrapped_modules(model: torch.nn.Module) -> dict[str, int]:
    """How many modules of the trained model each wrapper holds, counted by type."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    kinds = {"fsdp": FSDPModule, "ddp": DistributedDataParallel, "activation_checkpoint": CheckpointWrapper,
             "compiled": torch._dynamo.OptimizedModule}  # fmt: skip
    chunks = getattr(model, "chunks", None) or []  # a pipeline rank's stages: wrapped one by one
    modules = {id(m): m for root in (model, *chunks) for m in root.modules()}.values()
    counts = {name: sum(isinstance(m, cls) for m in modules) for name, cls in kinds.items()}
    counts["pp_stages"] = len(chunks)  # the pipeline stages this rank runs
    # FSDP units that free their gathered parameters after forward (all but the root; under
    # pipeline parallelism none: a stage's stay unsharded through its micro-batches)
    counts["fsdp_reshard_after_forward"] = sum(
        isinstance(m, FSDPModule)
        and any(g.post_forward_mesh_info is not None for g in m._get_fsdp_state()._fsdp_param_groups)
        for m in modules
    )
    # blocks under the selective per-op policy: their checkpoint runs with a context_fn
    counts["selective_checkpoint"] = sum(
        isinstance(m, CheckpointWrapper) and "context_fn" in getattr(m.checkpoint_fn, "keywords", {}) for m in modules
    )
    counts["params_held"] = len(list(model.parameters()))  # this rank's (rank 0's) parameter tensors
    # parameters FSDP all-gathers in fp8: their local shard is torchao's float8-cast weight
    local = [getattr(p, "_local_tensor", p) for p in model.parameters()]
    counts["fp8_all_gather_params"] = sum(isinstance(t, WeightWithDynamicFloat8CastTensor) for t in local)
    # scales precomputed for the next all-gather, one all-reduce for all weights (torchao's FSDP recipe)
    counts["fp8_precomputed_scales"] = sum(getattr(t, "_precomputed_scale", None) is not None for t in local)
    # HSDP: parameters replicated over the dp_replicate mesh dimension, sharded over dp_shard
    counts["hsdp_params"] = sum(_placed(p, "dp_replicate", "is_replicate") and _placed(p, "dp_shard", "is_shard")
                                for p in model.parameters())  # fmt: skip
    counts["tp_params"] = sum(_placed(p, "tp", "is_shard") for p in model.parameters())  # split by TP
    counts["tp_replicated_params"] = sum(_placed(p, "tp", "is_replicate") for p in model.parameters())  # whole
    from torchao.float8.float8_linear import Float8Linear

    # Float8Linear modules whose weight is a DTensor split over tp (torchao's float8 TP styles)
    counts["float8_tp_linear"] = sum(
        isinstance(m, Float8Linear) and _placed(m.weight, "tp", "is_shard") for m in model.modules()
    )
    return counts


def _placed(p, dim: str, kind: str) -> bool:
    """Whether DTensor parameter `p` is placed `kind` (is_shard, is_replicate) on mesh dimension `dim`."""
    mesh = getattr(p, "device_mesh", None)
    names = tuple(mesh.mesh_dim_names or ()) if mesh is not None else ()
    return dim in names and getattr(p.placements[names.index(dim)], kind)()


def hand_back(job: Job, result: WorkerResult) -> None:
    """Rank 0 returns everything through the store, the one thing a driver pod shares with
    the replicas: the model (Hugging Face export plus the training records), then the run's
    record (`run/<identity>@<launch id>`: the result and metrics.jsonl) naming it. The model
    carries the training records and the TensorBoard events, so they outlive the pods. Nothing is
    published once the driver has lost the run's lease to another run of this identity."""
    check_held_by_launch(job.store, job.identity, job.spec.launch_id)
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
            "start_step", "skipped_samples")  # fmt: skip
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
            **mixture_record(job, result),
        },
        parents=[job.spec.dataset, f"checkpoint/{job.model_cfg.name}@{result.checkpoint_version}"],
    )
    with tempfile.TemporaryDirectory() as staging:  # the record exists only in the store
        record = Path(staging)
        handed = dataclasses.replace(result, model=str(model.ref))
        (record / "result.json").write_text(json.dumps(handed.to_json(), indent=2))
        shutil.copyfile(run_dir / "metrics.jsonl", record / "metrics.jsonl")
        job.store.publish("run", job.identity, job.spec.launch_id, record, parents=[str(model.ref)])


def mixture_record(job: Job, result: WorkerResult) -> dict:
    """A mixture's model names each source's dataset version, its weight, its cap and the samples
    it gave the run (the sampler's count at the final step); nothing for one source."""
    if not job.spec.mixture:
        return {}
    sources = job.store.manifest(Ref.parse(job.spec.dataset)).metadata["sources"]
    drawn = result.drawn
    return {
        "mixture": {
            name: {"dataset": sources[name], "weight": w, "max_epochs": job.spec.max_epochs.get(name),
                   "drawn": drawn[name]}
            for name, w in job.spec.mixture.items()
        }
    }  # fmt: skip


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
