"""Process group, compile and data parallelism: DDP (default), FSDP2 `fully_shard`, or HSDP
(`fully_shard` on a 2-D mesh: `dp_replicate` groups, each sharding over world / dp_replicate)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from components.config import Parallelism
from components.precision import Recipe
from components.train.model import transformer_blocks


def apply_compile(model: torch.nn.Module) -> None:
    """torch.compile each transformer block (as torchtitan): identical blocks share one
    compiled graph, and a graph break stays inside one block."""
    blocks = transformer_blocks(model)
    for i in range(len(blocks)):
        blocks[i] = torch.compile(blocks[i], fullgraph=True)


def dp_mesh(device: torch.device, dp_replicate: int):
    """The data-parallel DeviceMesh: 1-D over the world (FSDP), or (dp_replicate, dp_shard) with
    consecutive ranks (one node's GPUs) in one shard group (HSDP)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if dp_replicate == 1:
        return init_device_mesh(device.type, (world,), mesh_dim_names=("dp_shard",))
    return init_device_mesh(
        device.type, (dp_replicate, world // dp_replicate), mesh_dim_names=("dp_replicate", "dp_shard")
    )


def wrap(
    model: torch.nn.Module, parallelism: Parallelism, device: torch.device, precision: Recipe, dp_replicate: int = 1
) -> torch.nn.Module:
    if parallelism == Parallelism.fsdp and dist.get_world_size() > 1:
        from torch.distributed.fsdp import fully_shard

        kwargs = {"mesh": dp_mesh(device, dp_replicate)}
        if (policy := precision.fsdp_mp_policy()) is not None:
            kwargs["mp_policy"] = policy
        for block in transformer_blocks(model):
            fully_shard(block, **kwargs)
        # the root's parameters (embeddings, final norm, head) are needed again right at the
        # start of backward: keep them unsharded after forward
        fully_shard(model, reshard_after_forward=False, **kwargs)
        return model
    if dist.get_world_size() == 1:
        return model  # nothing to replicate or shard; DDP would only copy gradient buckets
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
