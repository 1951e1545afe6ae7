"""Linear warmup then cosine decay to min_lr, and the clipped optimizer step (AdamW: components/optimizer.py)."""

from __future__ import annotations

import math

import torch

from components.config import TrainConfig


def lr_at(step: int, cfg: TrainConfig) -> float:
    """The learning rate for optimizer step `step` (0-based)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def clip(model: torch.nn.Module, optimizer: torch.optim.Optimizer, max_norm: float,
         scaler: torch.amp.GradScaler | None, pp_group=None) -> torch.Tensor:  # fmt: skip
    """Unscale (if scaling) and clip the gradients to the global norm; the norm, on the device.
    Under pipeline parallelism a rank holds only its stages' gradients: the norm is summed over
    `pp_group`. Nothing is read back to the host."""
    import torch.distributed as dist

    if scaler is not None:
        scaler.unscale_(optimizer)  # records its own found-inf for `update`
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    if pp_group is not None:  # the norm over every stage: the root of the summed squares
        squares = norm.double() ** 2
        dist.all_reduce(squares, group=pp_group)
        norm = squares.sqrt().to(norm.dtype)
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def masked_step(optimizer: torch.optim.Optimizer, stepped: torch.Tensor, scaler: torch.amp.GradScaler | None) -> None:
    """The optimizer step where `stepped` (a device bool) holds, none where it does not, decided
    on the device: the fused AdamW kernel skips every update (and its step count) where its
    `found_inf` is 1, as it does for a GradScaler. With a scaler, the scale backs off where
    unscaling found an inf. Then the gradients are freed."""
    optimizer.found_inf = (~stepped).to(torch.float32)
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf
    if scaler is not None:
        scaler.update()
    optimizer.zero_grad(set_to_none=True)


def clip_and_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    max_norm: float,
    scaler: torch.amp.GradScaler | None,
    pp_group=None,
) -> tuple[float, bool]:
    """`clip` then a step where every gradient is finite, decided on the host: (the norm, whether
    it stepped), read back. For any optimizer (the benchmarks', the unit tests'); training
    decides with its guards on the device (`masked_step`)."""
    norm = clip(model, optimizer, max_norm, scaler, pp_group)
    stepped = bool(torch.isfinite(norm))
    if stepped:
        optimizer.step()
    if scaler is not None:
        scaler.update()  # backs off where unscaling found an inf
    optimizer.zero_grad(set_to_none=True)
    return float(norm), stepped
