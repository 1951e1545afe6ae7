"""Activation checkpointing per transformer block (every n-th), applied before FSDP."""

from __future__ import annotations

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from components.train.model import transformer_blocks


def apply_activation_checkpointing(model: torch.nn.Module, every_n: int) -> int:
    """Recompute the activations of every n-th block in backward; return how many were wrapped."""
    blocks = transformer_blocks(model)
    wrapped = 0
    for i in range(len(blocks)):
        if i % every_n == 0:
            blocks[i] = checkpoint_wrapper(blocks[i], preserve_rng_state=False)
            wrapped += 1
    return wrapped
