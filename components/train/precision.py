"""Compute precision: fp32, bf16 autocast, or torchao float8 training on eligible Linears."""

from __future__ import annotations

import contextlib
import logging

import torch

from components.config import Precision, TrainConfig
from components.train.inputs import PrecisionError

log = logging.getLogger(__name__)


def fp8_eligible(name: str, module: torch.nn.Module) -> bool:
    """Float8 GEMMs need both dims divisible by 16; the output head stays high precision
    (as in torchtitan: its logits feed the loss directly)."""
    return (
        isinstance(module, torch.nn.Linear)
        and name != "lm_head"
        and module.in_features % 16 == 0
        and module.out_features % 16 == 0
    )


def check_fp8_device(device: torch.device) -> None:
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise PrecisionError(
                f"train.precision=fp8 needs a GPU with compute capability >= 8.9 (Ada, Hopper, Blackwell); "
                f"{torch.cuda.get_device_name(device)} has {major}.{minor}. Use train.precision=bf16."
            )


def apply_fp8(model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> list[str]:
    """Swap eligible nn.Linear for torchao Float8Linear; return the converted names."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    check_fp8_device(device)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    eligible = [n for n, m in linears.items() if fp8_eligible(n, m)]
    if not eligible:
        raise PrecisionError(
            "train.precision=fp8 but no Linear layer has both dims divisible by 16: "
            f"{ {n: (m.in_features, m.out_features) for n, m in linears.items()} }"
        )
    config = Float8LinearConfig.from_recipe_name(cfg.fp8_recipe.value)
    convert_to_float8_training(model, config=config, module_filter_fn=fp8_eligible)
    skipped = sorted(set(linears) - set(eligible))
    log.info("fp8 (%s): %d Float8Linear layers: %s", cfg.fp8_recipe.value, len(eligible), ", ".join(eligible))
    log.info("fp8: kept in high precision: %s", ", ".join(skipped) or "none")
    return eligible


def autocast(cfg: TrainConfig, device: torch.device):
    if cfg.precision == Precision.bf16:
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
