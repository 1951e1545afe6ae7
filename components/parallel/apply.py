"""The one place that applies a layout (`ParallelDims`, components/parallel/): pipeline
stages (components/parallel/pipeline.py), tensor parallelism in each
(components/parallel/tensor.py), activation checkpointing, compile, then DDP, FSDP2
`fully_shard`, or HSDP (`fully_shard` on the (dp_replicate, dp_shard) dimensions)."""

from __future__ import annotations

import contextlib

import torch

from components.models import transformer_blocks
from components.parallel import ParallelDims, sequence_parallel
from components.precision import Recipe


def apply_compile(model: torch.nn.Module) -> None:
    """torch.compile each transformer block (as torchtitan): identical blocks share one
    compiled graph, and a graph break stays inside one block."""
    blocks = transformer_blocks(model)
    for key, block in list(blocks.named_children()):
        setattr(blocks, key, torch.compile(block, fullgraph=True))


def parallelize(model: torch.nn.Module, train, dims: ParallelDims, device: torch.device, precision: Recipe):
    """The one place a layout is applied, in torchtitan's order, to a model whose precision
    conversion is done: PP split or TP (with sequence parallel) -> activation checkpointing -> compile -> FSDP2 / HSDP
    or DDP. Under pipeline parallelism it returns this rank's `PipelineRank`."""
    from components.parallel.checkpointing import apply_activation_checkpointing

    mesh = dims.mesh(device.type)
    if dims.tp > 1 and train.async_tp:  # before any block is compiled, pipelined or not
        enable_async_tp(mesh["tp"], device)
    if dims.pp > 1:
        return pipeline_rank(model, train, dims, device, precision, mesh)
    if dims.tp > 1:
        from components.parallel.tensor import apply_tp

        sp = sequence_parallel(train, model.config.tie_word_embeddings, device.type == "cuda")
        apply_tp(model, mesh["tp"], sp)
    apply_activation_checkpointing(model, train.activation_checkpointing, train.ac_every_n_blocks)
    if train.compile if train.compile is not None else device.type == "cuda":
        apply_compile(model)
    return wrap(model, dims, device, precision, mesh)


def enable_async_tp(tp_mesh, device: torch.device) -> None:
    """torchtitan's async TP: the tp group's buffers in symmetric memory and inductor's
    micro-pipeline pass, which splits each all-gather (reduce-scatter) and the matmul after
    (before) it into chunks that overlap, in the blocks `apply_compile` compiles next."""
    if device.type != "cuda":
        raise RuntimeError(f"train.async_tp needs CUDA GPUs (symmetric memory), this rank runs on {device}")
    import warnings

    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated once torch registers the group itself
        enable_symm_mem_for_group(tp_mesh.get_group().group_name)
    torch._inductor.config._micro_pipeline_tp = True


def pipeline_rank(model: torch.nn.Module, train, dims: ParallelDims, device: torch.device, precision: Recipe, mesh):
    """Cut the model into this rank's pipeline stages; checkpoint, compile and wrap each
    (FSDP2 over the data-parallel dimensions); gather them under one module."""
    from components.parallel.checkpointing import apply_activation_checkpointing
    from components.parallel.pipeline import PipelineRank, build_stages, stages_per_rank

    sharded = dims.fsdp
    stage_sp = sequence_parallel(train, model.config.tie_word_embeddings, device.type == "cuda")
    pp_rank = mesh["pp"].get_local_rank()
    chunks, ids = build_stages(model, pp_rank, dims.pp, train.pp_schedule, lambda: precision.autocast(device, sharded))
    wrapped = []
    for chunk in chunks:
        if dims.tp > 1:  # each stage's blocks (and its ends) split over the stage's tp ranks
            from components.parallel.tensor import apply_tp

            apply_tp(chunk, mesh["tp"], stage_sp)
        apply_activation_checkpointing(chunk, train.activation_checkpointing, train.ac_every_n_blocks)
        if train.compile if train.compile is not None else device.type == "cuda":
            apply_compile(chunk)
        wrapped.append(wrap(chunk, dims, device, precision, mesh))
    rank_module = PipelineRank(model, wrapped, ids, dims.pp * stages_per_rank(train.pp_schedule))
    rank_module.pp_mesh = mesh["pp"]
    return rank_module


def wrap(model: torch.nn.Module, dims: ParallelDims, device: torch.device, precision: Recipe, mesh=None):
    """Data parallelism: FSDP2 / HSDP over the data-parallel mesh dimensions, or DDP over the
    world (only where no dimension is tensor- or pipeline-parallel: DDP does not replicate
    DTensors, and its bucket order breaks when a schedule runs several forwards before a
    backward; torchtitan refuses DDP beside other dimensions too)."""
    mesh = mesh if mesh is not None else dims.mesh(device.type)
    if dims.fsdp:
        from torch.distributed.fsdp import fully_shard

        names = tuple(n for n in ("dp_replicate", "dp_shard") if n in mesh.mesh_dim_names)
        kwargs = {"mesh": mesh[names] if len(names) > 1 else mesh[names[0]]}
        if (policy := precision.fsdp_mp_policy()) is not None:
            kwargs["mp_policy"] = policy
        # under pipeline parallelism a stage's blocks stay unsharded after forward (torchtitan's
        # choice): the schedule runs every micro-batch through them, and torch keeps them
        # unsharded from their first backward to the step's end anyway, so one all-gather a
        # step instead of one per micro-batch, at the same peak
        for block in transformer_blocks(model).children():  # a ModuleList, or a stage's ModuleDict
            fully_shard(block, reshard_after_forward=dims.pp == 1, **kwargs)
        # the root's parameters (embeddings, final norm, head) are needed again right at the
        # start of backward: keep them unsharded after forward (a pipeline stage's too: the
        # schedule runs many micro-batches through it before its last backward)
        fully_shard(model, reshard_after_forward=False, **kwargs)
        return model
    if dims.dp == 1:
        return model  # nothing to replicate or shard; DDP would only copy gradient buckets
    if dims.tp > 1:
        raise ValueError(f"train.tp={dims.tp} with {dims.dp} DDP replicas: use train.parallelism=fsdp")
    from torch.nn.parallel import DistributedDataParallel

    if dims.pp > 1:
        raise ValueError(f"train.pp={dims.pp} with {dims.dp} DDP replicas: use train.parallelism=fsdp")

    # Buffers (rotary frequencies) are identical constants on every rank: broadcasting them
    # each forward would add a collective to the forward pass. Gradients are views into the
    # reduction buckets, so they take 4 bytes per parameter once, not twice.
    return DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        broadcast_buffers=False,
        gradient_as_bucket_view=True,
    )


def gradient_sync(model: torch.nn.Module, last: bool, fsdp_every_microbatch: bool = True):
    """Gradient accumulation. DDP reduces only on the last micro-batch (`no_sync()` before it:
    its gradients are whole on every rank anyway). FSDP2 reduce-scatters after every micro-batch
    when `fsdp_every_microbatch`, so what accumulates is each rank's gradient shard; otherwise
    it syncs the last only (`set_requires_gradient_sync`), keeping unsharded fp32 gradients."""
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(last or fsdp_every_microbatch)
        return contextlib.nullcontext()
    if last or not hasattr(model, "no_sync"):
        return contextlib.nullcontext()
    return model.no_sync()
