"""fp32: master weights, activations and GEMMs all in float32."""

from __future__ import annotations

from components.precision.base import Recipe


class FP32(Recipe):
    pass
