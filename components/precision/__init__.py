"""Compute precision as one recipe per precision: what it converts, how it autocasts, what
FSDP all-gathers, which GEMM preflight times for it, and what memory its copies take.

`recipe(Precision.fp8)` is the only entry point; train, preflight and the planner all ask it.
"""

from __future__ import annotations

from components.config import Precision
from components.precision.base import PrecisionError, Recipe, fp8_eligible_dims
from components.precision.bf16 import BF16
from components.precision.fp8 import FP8
from components.precision.fp32 import FP32

RECIPES: dict[Precision, Recipe] = {Precision.fp32: FP32(), Precision.bf16: BF16(), Precision.fp8: FP8()}


def recipe(precision: Precision | str) -> Recipe:
    return RECIPES[Precision(precision)]


__all__ = ["RECIPES", "PrecisionError", "Recipe", "fp8_eligible_dims", "recipe"]
