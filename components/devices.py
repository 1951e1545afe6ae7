"""Published dense peak TFLOP/s of the accelerators liftoff runs on, looked up by device name.

Dense (no 2:4 sparsity) tensor-core figures from the vendors' data sheets. MFU is reported
against the bf16 peak, as torchtitan and PaLM do, whatever the training precision.
"""

from __future__ import annotations

# (substring of torch.cuda.get_device_name, {dtype: dense peak TFLOP/s}); first match wins,
# so the more specific names come first.
PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    ("H100 PCIe", {"bf16": 756.0, "fp8": 1513.0}),
    ("H100", {"bf16": 989.4, "fp8": 1978.9}),  # SXM
    ("H200", {"bf16": 989.4, "fp8": 1978.9}),
    ("GH200", {"bf16": 989.4, "fp8": 1978.9}),
    ("B200", {"bf16": 2250.0, "fp8": 4500.0}),
    ("A100", {"bf16": 312.0}),
    ("L40S", {"bf16": 362.1, "fp8": 733.0}),
    ("MI300X", {"bf16": 1307.4, "fp8": 2614.9}),
]


def peak_tflops(device_name: str, dtype: str = "bf16") -> float | None:
    """The dense peak for `dtype` of the device whose name contains a known model, else None."""
    for key, peaks in PEAK_TFLOPS:
        if key.lower() in device_name.lower():
            return peaks.get(dtype)
    return None
