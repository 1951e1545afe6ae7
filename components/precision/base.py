"""What every precision recipe answers; fp32 is the plain case, the others override."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from components.config import ModelConfig, TrainConfig

if TYPE_CHECKING:  # torch is imported where it is used: the planner and stage checks run without it
    import torch


class PrecisionError(ValueError):
    """A precision that cannot run on this model or device; raised before training starts."""


def fp8_eligible_dims(in_features: int, out_features: int) -> bool:
    """Float8 GEMMs (torch._scaled_mm) need both dims divisible by 16."""
    return in_features % 16 == 0 and out_features % 16 == 0


# what sequence parallel moves from whole to split per hidden unit and token: the residual
# stream's and the two RMSNorms' saved tensors (benchmarks/planner_accuracy.py's counting)
SP_SPLIT_BYTES_PER_HIDDEN = 16.0

# Under FSDP's mixed-precision policy the gathered parameters are in the compute dtype (the
# embedding's too), so the residual stream a block saves is too (torchtitan's recipe), where
# autocast (DDP, one device) keeps it fp32: per hidden unit and token a bf16 block saves this
# much less (under sequence parallel 6 B of the whole and 4 B of the split part), and its
# checkpoint keeps its input at the compute dtype (counted under fake FSDP groups of 2, 4 and
# 8 ranks with tp 1, 2 and 4, benchmarks/planner_accuracy.py's `fsdp_` rows)
FSDP_MP_BYTES_PER_HIDDEN = 10.0


class Recipe:
    name = "fp32"
    compute_dtype = "float32"  # torch dtype name: what activations, norms and attention compute in
    # Bytes saved for backward per token by one Llama block (transformers, SDPA), per unit of
    # hidden size, of key/value width (h·kv_heads/heads: SDPA's GQA keeps k and v at that width)
    # and of FFN size, and by the head per unit of hidden size; counted with saved_tensors_hooks
    # (benchmarks/planner_accuracy.py). fp32: 8 hidden-sized, 2 kv-sized (k, v) and 4 FFN-sized
    # tensors per block; under bf16 autocast the residual stream and the RMSNorm internals stay
    # fp32, the projections' inputs, k, v and the MLP are bf16.
    act_bytes_per_hidden = 32.0
    # Of those, the hidden-sized tensors inside attention (q, the attention output) that tensor
    # parallelism splits with the heads; the rest (the residual stream, the RMSNorms and the
    # projections' inputs) stays whole on every tp rank without sequence parallelism. The kv,
    # FFN and log-sum-exp terms split whole. Counted under a tp=2 fake process group: fp32
    # 2 tensors (8 B), bf16 2 bf16 tensors (4 B).
    act_split_bytes_per_hidden = 8.0
    act_bytes_per_kv = 8.0
    act_bytes_per_ffn = 16.0
    head_bytes_per_hidden = 12.0
    fsdp_head_bytes_per_hidden = 12.0  # the same under FSDP's mixed-precision policy

    @property
    def compute_bytes(self) -> float:
        """Bytes of one element in the compute dtype (activations, the head's logits, TP's collectives)."""
        return 4.0 if self.compute_dtype == "float32" else 2.0

    def check_model(self, model: ModelConfig) -> None:
        """Pre-launch check on the config alone (no torch model is built)."""

    def check_device(self, device: torch.device) -> None:
        """Raise PrecisionError when this device cannot run the recipe."""

    def apply(self, model: torch.nn.Module, train: TrainConfig, device: torch.device) -> None:
        """Convert modules in place, before activation checkpointing, compile and FSDP."""

    def autocast(self, device: torch.device, fsdp: bool):
        """The forward's autocast context. Under FSDP the MixedPrecisionPolicy casts the
        parameters instead (torchtitan's choice), so no autocast is needed there."""
        return contextlib.nullcontext()

    def fsdp_mp_policy(self):
        """FSDP2 MixedPrecisionPolicy, or None for full fp32."""
        return None

    def after_optimizer_step(self, model: torch.nn.Module, train: TrainConfig, fsdp: bool) -> None:
        """Per-step work once the weights changed (fp8: precompute the all-gather scales)."""

    def block_act_bytes(self, tp: int, sp: bool = False, fsdp: bool = False) -> tuple[float, float, float, float]:
        """A block's saved bytes per token: (whole per hidden, split over tp per hidden, per kv
        width, per FFN width), the last two split over tp too. Sequence parallel (`sp`) splits
        the residual stream and the norms' tensors along the sequence: 16 B per hidden unit
        more are split (counted under tp 2 and 4 fake process groups, fp32 and bf16 alike).
        Under FSDP (`fsdp`) a mixed-precision residual stream is in the compute dtype."""
        split = self.act_split_bytes_per_hidden
        whole = self.act_bytes_per_hidden - split
        if sp:
            whole, split = whole - SP_SPLIT_BYTES_PER_HIDDEN, split + SP_SPLIT_BYTES_PER_HIDDEN
        return (*self.fsdp_residual(whole, split, sp, fsdp), self.act_bytes_per_kv, self.act_bytes_per_ffn)

    def fsdp_residual(self, whole: float, split: float, sp: bool, fsdp: bool) -> tuple[float, float]:
        """(whole, split) per hidden less what FSDP's mixed precision saves of the residual stream
        (split along the sequence under sequence parallel)."""
        if not fsdp or self.compute_dtype == "float32":
            return whole, split
        return (whole - 6.0, split - 4.0) if sp else (whole - FSDP_MP_BYTES_PER_HIDDEN, split)

    def input_bytes(self, fsdp: bool) -> float:
        """Bytes per hidden unit of a block's input (what a checkpoint keeps): fp32, or the
        compute dtype under FSDP's mixed-precision policy."""
        return self.compute_bytes if fsdp else 4.0

    def copy_bytes(self, linear: bool, fp8_eligible: bool, fsdp: bool, train: TrainConfig) -> float:
        """Bytes per element of the compute copy of one parameter, beside its fp32 master.

        Under FSDP that is the unsharded (all-gathered) parameter while its block computes;
        under DDP, the low-precision copy autocast caches for the step (Linear weights only)."""
        return 4.0 if fsdp else 0.0

    def gemm(self, size: int, device: torch.device) -> Callable[[], object]:
        """The matmul preflight times for this precision (size x size x size)."""
        import torch

        torch.manual_seed(0)
        dtype = getattr(torch, self.compute_dtype)
        a = torch.randn(size, size, device=device, dtype=dtype)
        b = torch.randn(size, size, device=device, dtype=dtype)
        return lambda: torch.mm(a, b)

    def describe(self, model: torch.nn.Module, train: TrainConfig) -> dict:
        """What this recipe made of the live model, read off it: its low-precision modules by
        qualified name, their cast configurations, and the recipe in words (`said`)."""
        return {"float8_linear_modules": [], "float8_cast_configs": [], "said": train.precision.value}

    def supported(self, device: torch.device) -> bool:
        try:
            self.check_device(device)
            return True
        except PrecisionError:
            return False
