"""The world's layout (`ParallelDims`, one DeviceMesh) and the one place that applies it:
tensor parallelism (components/train/tensor_parallel.py), then DDP (default), FSDP2
`fully_shard`, or HSDP (`fully_shard` on the (dp_replicate, dp_shard) dimensions); and compile."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from components.config import Parallelism
from components.precision import Recipe
from components.train.model import transformer_blocks


def apply_compile(model: torch.nn.Module) -> None:
    """torch.compile each transformer block (as torchtitan): identical blocks share one
    compiled graph, and a graph break stays inside one block."""
    blocks = transformer_blocks(model)
    for i in range(len(blocks)):
        blocks[i] = torch.compile(blocks[i], fullgraph=True)


@dataclass(frozen=True)
class ParallelDims:
    """The layout of the world: `tp` consecutive ranks split each block's matmuls; the
    world / tp data-parallel ranks are DDP replicas, or FSDP shard groups of `dp_shard` ranks
    repeated `dp_replicate` times (HSDP). Rank r is data-parallel rank r // tp, tp rank r % tp."""

    world: int
    tp: int = 1
    dp_replicate: int = 1
    fsdp: bool = False

    @classmethod
    def of(cls, train, world: int) -> ParallelDims:
        return cls(world, train.tp, train.dp_replicate, train.parallelism == Parallelism.fsdp)

    @property
    def dp(self) -> int:
        return self.world // self.tp

    @property
    def dp_shard(self) -> int:
        return self.dp // self.dp_replicate if self.fsdp else 1

    def dp_rank(self, rank: int) -> int:
        return rank // self.tp

    def mesh(self, device: torch.device):
        """One DeviceMesh over the world, a dimension per degree above 1 (dp_replicate,
        dp_shard, tp, outermost first), or None for one process."""
        from torch.distributed.device_mesh import init_device_mesh

        dims = [("dp_replicate", self.dp_replicate), ("dp_shard", self.dp_shard), ("tp", self.tp)]
        dims = [(name, n) for name, n in dims if n > 1]
        if not dims:
            return None
        return init_device_mesh(device.type, tuple(n for _, n in dims), mesh_dim_names=tuple(name for name, _ in dims))


def parallelize(model: torch.nn.Module, train, dims: ParallelDims, device: torch.device, precision: Recipe):
    """The one place a layout is applied, in torchtitan's order, to a model whose precision
    conversion is done: TP -> activation checkpointing -> compile -> FSDP2 / HSDP or DDP."""
    from components.train.activation_checkpoint import apply_activation_checkpointing

    mesh = dims.mesh(device)
    if dims.tp > 1:
        from components.train.tensor_parallel import apply_tp

        apply_tp(model, mesh["tp"])
    if train.activation_checkpointing:
        apply_activation_checkpointing(model, train.ac_every_n_blocks)
    if train.compile if train.compile is not None else device.type == "cuda":
        apply_compile(model)
    return wrap(model, dims, device, precision, mesh)


def wrap(model: torch.nn.Module, dims: ParallelDims, device: torch.device, precision: Recipe, mesh=None):
    """Data parallelism: FSDP2 / HSDP over the data-parallel mesh dimensions, or DDP over the
    world (only where no dimension is tensor-parallel: DDP does not replicate DTensors)."""
    mesh = mesh if mesh is not None else dims.mesh(device)
    if dims.fsdp and dims.dp > 1:
        from torch.distributed.fsdp import fully_shard

        names = tuple(n for n in ("dp_replicate", "dp_shard") if n in mesh.mesh_dim_names)
        kwargs = {"mesh": mesh[names] if len(names) > 1 else mesh[names[0]]}
        if (policy := precision.fsdp_mp_policy()) is not None:
            kwargs["mp_policy"] = policy
        for block in transformer_blocks(model):
            fully_shard(block, **kwargs)
        # the root's parameters (embeddings, final norm, head) are needed again right at the
        # start of backward: keep them unsharded after forward
        fully_shard(model, reshard_after_forward=False, **kwargs)
        return model
    if dims.dp == 1:
        return model  # nothing to replicate or shard; DDP would only copy gradient buckets
    if dims.tp > 1:
        raise ValueError(f"train.tp={dims.tp} with {dims.dp} DDP replicas: use train.parallelism=fsdp")
    from torch.nn.parallel import DistributedDataParallel

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
