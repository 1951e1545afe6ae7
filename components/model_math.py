"""Model math on the shared floor, one place for train, preflight and the planner: the tensors
a `ModelConfig` builds (its family's), training FLOPs per token, MFU and this host's memory."""

from __future__ import annotations

import os

from components.config import ModelConfig
from components.models import spec_for


def param_tensors(model: ModelConfig) -> list[tuple[str, int, bool]]:
    """(kind, numel, is an fp8-eligible Linear weight) for every parameter tensor the model's
    family builds (components/models/: its `param_tensors`)."""
    return spec_for(model).param_tensors(model)


def stage_layers(num_layers: int, stages: int) -> list[range]:
    """Pipeline parallelism's cut: consecutive blocks per stage, as even as they go (earlier
    stages take the remainder). The trainer's stages and the planner's both come from here."""
    if num_layers < stages:
        raise ValueError(f"{num_layers} blocks cannot fill {stages} pipeline stages (train.pp x stages per rank)")
    base, extra = divmod(num_layers, stages)
    out, start = [], 0
    for s in range(stages):
        n = base + (s < extra)
        out.append(range(start, start + n))
        start += n
    return out


def flops_per_token(cfg: ModelConfig, n_params_no_embed: int, seq_len: int) -> float:
    """Training FLOPs per token: 6N for the matmuls (forward 2N, backward 4N) plus
    12·L·H·Q·T for attention scores and values (L layers, H heads, Q head dim, T seq len),
    as in PaLM's MFU definition."""
    head_dim = cfg.hidden_size // cfg.num_heads
    return 6 * n_params_no_embed + 12 * cfg.num_layers * cfg.num_heads * head_dim * seq_len


# the kinds of `param_tensors` inside the repeated blocks, and those a matmul multiplies by
BLOCK_KINDS = ("linear", "block_norm", "router", "expert")
MATMUL_KINDS = ("linear", "head", "router", "expert")


def active(cfg: ModelConfig, kind: str, numel: int) -> float:
    """The elements of a parameter tensor one token's forward multiplies by: all of them, but of
    an "expert" tensor (every expert's weights stacked) the experts_per_token it is routed to."""
    return numel * cfg.experts_per_token / cfg.num_experts if kind == "expert" else numel


def planned_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """`flops_per_token` from the tensor layout, before any model is built: of a mixture of
    experts, its active parameters (the MFU a run reports counts those too)."""
    n = sum(active(cfg, kind, numel) for kind, numel, _ in param_tensors(cfg))
    return flops_per_token(cfg, n - (cfg.vocab_size or 0) * cfg.hidden_size, seq_len)


def mfu(tokens_per_second: float, flops_per_token: float, peak_tflops: float | None, devices: int) -> float | None:
    """Model FLOPs utilization: achieved training FLOP/s over the peak of all devices."""
    if not peak_tflops:
        return None
    return tokens_per_second * flops_per_token / (peak_tflops * 1e12 * devices)


def host_memory_bytes() -> int:
    """This host's physical memory (what a CPU "device" has)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
