"""Activation checkpointing per transformer block, applied before FSDP: `full` recomputes every
n-th block whole in backward; `selective` (torchtitan's per-op policy) wraps every block but
keeps some op outputs, recomputing only the cheap rest.

The selective rule: in each block's forward the outputs of attention (SDPA: its output and
log-sum-exp), of reduce-scatters and amax reductions (fp8 scales) and of every other matmul
(the 1st, 3rd, 5th, ...: for Llama q, v, gate and down of the seven) are saved; everything else
(the other matmuls, norms, rotary, activations, elementwise ops) is recomputed in backward.
Attention, the costliest op to recompute at long sequences, is never recomputed, and half the
matmul outputs are.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from components.models import transformer_blocks

_aten = torch.ops.aten
SAVED_OPS = {
    _aten.mm.default,
    _aten._scaled_mm.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten.max.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
}


def _policy() -> Callable:
    """The rule for one block's forward (its recompute replays the forward's choices)."""
    matmuls = 0

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        nonlocal matmuls
        if func == _aten.mm.default:
            matmuls += 1
        every_other = func == _aten.mm.default and matmuls % 2 == 0
        return (
            CheckpointPolicy.MUST_SAVE if func in SAVED_OPS and not every_other else CheckpointPolicy.PREFER_RECOMPUTE
        )

    return policy


def selective_context():
    """The contexts one checkpointed forward (and its recompute) runs under: a fresh matmul
    count each time, so every block saves the same matmuls."""
    return create_selective_checkpoint_contexts(_policy())


def apply_activation_checkpointing(
    model: torch.nn.Module, mode: str, every_n: int, context_fn: Callable = selective_context
) -> int:
    """`full`: recompute every n-th block whole in backward (counted in the whole model: a
    pipeline stage's blocks keep their indices); `selective`: every block under the per-op
    policy (`context_fn`). Returns how many blocks were wrapped."""
    if mode == "off":
        return 0
    blocks = transformer_blocks(model)
    wrapped = 0
    for key, block in list(blocks.named_children()):
        if mode == "selective":
            setattr(blocks, key, checkpoint_wrapper(block, context_fn=context_fn, preserve_rng_state=False))
        elif int(key) % every_n == 0:
            setattr(blocks, key, checkpoint_wrapper(block, preserve_rng_state=False))
        else:
            continue
        wrapped += 1
    return wrapped
