"""Finding where a non-finite value starts: replay a micro-batch with forward hooks."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from components.models import ModelSpec

_WRAPPER_PARTS = ("_checkpoint_wrapped_module", "_orig_mod")  # activation checkpointing, torch.compile


def clean_name(name: str) -> str:
    """The module's name in the plain model, without what DDP, AC and compile wrap around it."""
    parts = [p for p in name.split(".") if p not in _WRAPPER_PARTS]
    return ".".join(parts[1:] if parts[:1] == ["module"] else parts)


def _nonfinite(output) -> bool:
    """Whether this rank's part of a module's output holds a non-finite value (a DTensor's local
    shard: no collective in a hook; `earliest_culprit` gathers every rank's finding)."""
    from torch.distributed.tensor import DTensor

    tensors = output if isinstance(output, (tuple, list)) else [getattr(output, "logits", output)]
    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    return any(isinstance(t, torch.Tensor) and t.is_floating_point() and not torch.isfinite(t).all() for t in local)


def first_nonfinite_module(model: torch.nn.Module, forward: Callable[[], object]) -> str | None:
    """Run `forward` without grad; return the first module (in execution order) whose output
    is not finite. Forward hooks fire when a module finishes, so a child reports before its
    parent and the earliest culprit is the one named."""
    found: list[str] = []
    handles = []
    for name, module in model.named_modules():
        if not name:
            continue

        def hook(mod, args, output, name=name):
            if not found and _nonfinite(output):
                found.append(clean_name(name))

        handles.append(module.register_forward_hook(hook))
    try:
        # compiled blocks replay eagerly: a data-dependent check in a hook cannot be traced
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            forward()
    finally:
        for h in handles:
            h.remove()
    return found[0] if found else None


def earliest_culprit(mine: str | None, spec: ModelSpec) -> str | None:
    """The first non-finite module of the whole forward, from every rank's own (a collective):
    under pipeline parallelism each rank sees only its stages' modules, and under data
    parallelism its own batch. Within one block (a stage holds it whole, so only data-parallel
    ranks tie there) the lowest rank's is kept."""
    found: list = [None] * dist.get_world_size()
    dist.all_gather_object(found, mine)
    named = [(spec.forward_position(n), rank, n) for rank, n in enumerate(found) if n is not None]
    return min(named)[2] if named else None
