"""Process group and data parallelism: DDP (default) or FSDP2 `fully_shard`."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from components.config import Parallelism
from components.train.model import transformer_blocks


def init_distributed(timeout_s: float) -> tuple[int, int, torch.device]:
    """gloo on CPU, NCCL on GPU; returns (rank, world size, device)."""
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size(), device


def wrap(model: torch.nn.Module, parallelism: Parallelism, device: torch.device) -> torch.nn.Module:
    if dist.get_world_size() == 1:
        return model  # nothing to replicate or shard; DDP would only copy gradient buckets
    if parallelism == Parallelism.fsdp:
        from torch.distributed.fsdp import fully_shard

        for block in transformer_blocks(model):
            fully_shard(block)
        fully_shard(model)
        return model
    from torch.nn.parallel import DistributedDataParallel

    # Buffers (rotary frequencies) are identical constants on every rank: broadcasting them
    # each forward would add a collective to the forward pass.
    return DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False
    )


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if hasattr(model, "module") and hasattr(model, "no_sync") else model
