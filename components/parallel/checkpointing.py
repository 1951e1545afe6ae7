"""Activation checkpointing per transformer block (every n-th), applied before FSDP."""

from __future__ import annotations

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from components.models import transformer_blocks


def apply_activation_checkpointing(model: torch.nn.Module, every_n: int) -> int:
    """Recompute the activations of every n-th block in backward (counted in the whole model:
    a pipeline stage's blocks keep their indices); return how many were wrapped."""
    blocks = transformer_blocks(model)
    wrapped = 0
    for key, block in list(blocks.named_children()):
        if int(key) % every_n == 0:
            setattr(blocks, key, checkpoint_wrapper(block, preserve_rng_state=False))
            wrapped += 1
    return wrapped
