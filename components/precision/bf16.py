"""bf16 mixed precision: fp32 master weights and optimizer state, bf16 compute.

DDP / one device: `torch.autocast(bf16)`, which caches a bf16 copy of every Linear weight
for the step. FSDP2: `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`: the
all-gathered (unsharded) parameters are bf16, gradients are reduced in fp32.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from components.precision.base import PrecisionError, Recipe

if TYPE_CHECKING:
    import torch


class BF16(Recipe):
    name = "bf16"
    compute_dtype = "bfloat16"
    act_bytes_per_hidden = 30.0
    act_split_bytes_per_hidden = 4.0
    act_bytes_per_kv = 4.0
    act_bytes_per_ffn = 8.0
    head_bytes_per_hidden = 10.5
    fsdp_head_bytes_per_hidden = 8.0

    def check_device(self, device: torch.device) -> None:
        import torch

        if device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise PrecisionError(
                f"train.precision={self.name} needs bf16 support; {torch.cuda.get_device_name(device)} has none"
            )

    def autocast(self, device: torch.device, fsdp: bool):
        import torch

        if fsdp:
            return super().autocast(device, fsdp)
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)

    def fsdp_mp_policy(self):
        import torch
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    def copy_bytes(self, linear: bool, fp8_eligible: bool, fsdp: bool, train) -> float:
        return 2.0 if fsdp or linear else 0.0
