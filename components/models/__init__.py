"""Model families on the shared floor: each a `ModelSpec`, the one place that knows its layout.

A family is one file here (its spec and its modules), its YAML under conf/model/, and one line in
`FAMILIES`. The train stage, validate and evaluate, the planner, tensor and pipeline parallelism
and the benchmarks get the model through these functions; nothing outside this folder names a
family's module path (tests/test_layout.py checks the source).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from components.config import ModelConfig
from components.models.llama import Llama
from components.models.moe import Moe

if TYPE_CHECKING:
    import torch
    from torch import nn


class ModelSpec(Protocol):
    """What the project needs to know of a model family."""

    family: str
    model_type: str  # the Hugging Face config's model_type of what `build` makes
    head: str  # the output head's module name (never fp8)
    probe_norm: str  # the suffix of a norm whose weight dtype says what the forward computes in
    buffer_prefix: str  # the only buffers (not saved), rebuilt by `rebuild_buffers`

    def hf_config(self, cfg: ModelConfig, vocab_size: int): ...  # the export's config.json

    def build(self, cfg: ModelConfig, vocab_size: int, seed: int | None = None) -> nn.Module: ...

    def blocks(self, model: nn.Module) -> nn.Module: ...  # the repeated blocks (AC, FSDP units, stages)

    def embeddings(self, model: nn.Module) -> nn.Module: ...

    def tp_plan(self, tied: bool) -> tuple[dict[str, str], dict[str, str]]: ...  # per block, the ends

    def tie_again(self, model: nn.Module) -> None: ...

    def stage(self, full: nn.Module, layers: range, first: bool, last: bool, autocast: Callable) -> nn.Module: ...

    def rebuild_buffers(self, model: nn.Module, config, device: torch.device) -> None: ...

    def forward_position(self, name: str) -> tuple[int, int]: ...  # order in the forward (non-finite culprit)

    def param_tensors(self, model: ModelConfig) -> list[tuple[str, int, bool]]: ...  # the planner's tensors

    def aux_loss(self, model: nn.Module, output) -> torch.Tensor | None: ...  # added to the token loss

    def expert_load(self, model: nn.Module, output) -> torch.Tensor | None: ...  # tokens per expert


FAMILIES: dict[str, ModelSpec] = {"llama": Llama(), "moe": Moe()}


def spec_for(cfg: ModelConfig) -> ModelSpec:
    """The family a `model` config builds (`model.family`)."""
    return FAMILIES[cfg.family]


def spec_of(model: nn.Module) -> ModelSpec:
    """The family of a built model (a pipeline stage of one, or one DDP wraps), by its config's
    model_type."""
    config = getattr(getattr(model, "module", model), "config", None)  # DDP keeps it in .module
    kind = getattr(config, "model_type", None)
    for spec in FAMILIES.values():
        if spec.model_type == kind:
            return spec
    known = ", ".join(spec.model_type for spec in FAMILIES.values())
    raise ValueError(f"{type(model).__name__}: model_type {kind!r} is no family's here ({known})")


def build_model(cfg: ModelConfig, vocab_size: int, seed: int) -> nn.Module:
    """A freshly initialized model in fp32 (master weights stay fp32 whatever the compute precision)."""
    return spec_for(cfg).build(cfg, vocab_size, seed)


CAUSAL_SDPA = "liftoff_causal_sdpa"  # transformers' SDPA attention under a name no mask is made for


def attend_causally(model: nn.Module) -> None:
    """Train on packed blocks as they are: causal attention over the whole block, no padding and
    no document mask, so no mask is built. Under its own `sdpa` name, transformers builds the
    causal mask per forward and first checks the position ids for packed sequences, a host read
    of a device value every forward (on a GPU: the launch queue drains). Registered under a name
    the mask interface does not know, the same SDPA function gets no mask and runs `is_causal`.
    Training only: the saved config drops the implementation, and evaluation (padded batches)
    builds its own model with masks."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    config = model.config
    if config._attn_implementation == "sdpa":
        AttentionInterface.register(CAUSAL_SDPA, sdpa_attention_forward)
        config._attn_implementation = CAUSAL_SDPA


def transformer_blocks(model: nn.Module) -> nn.Module:
    return spec_of(model).blocks(model)


def count_params(model: nn.Module, exclude_embeddings: bool = False) -> int:
    n = sum(p.numel() for p in model.parameters())
    if exclude_embeddings:
        n -= spec_of(model).embeddings(model).weight.numel()
    return n


def token_loss(logits: torch.Tensor, targets: torch.Tensor, chunk_tokens: int = 0) -> torch.Tensor:
    """The mean token cross-entropy every layout trains on (the pipeline schedule's loss_fn too).

    With `chunk_tokens` (`train.loss_chunk_tokens`) it runs over chunks of that many tokens,
    each under activation checkpointing: the fp32 logits, their log-softmax and its gradients
    exist for one chunk at a time, forward and backward, and what is kept is the head's own
    output (in the compute dtype). A loss-parallel head's logits (a DTensor split over the
    vocabulary, already 1/tp) take the plain path."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor

    flat, flat_targets = logits.flatten(0, 1), targets.flatten()
    if not chunk_tokens or isinstance(flat, DTensor) or flat.shape[0] <= chunk_tokens:
        return F.cross_entropy(flat.float(), flat_targets)
    from torch.utils.checkpoint import checkpoint

    sums = [
        checkpoint(_chunk_loss, part, part_targets, use_reentrant=False)
        for part, part_targets in zip(flat.split(chunk_tokens), flat_targets.split(chunk_tokens), strict=True)
    ]
    return torch.stack(sums).sum() / flat_targets.numel()


def _chunk_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    import torch.nn.functional as F

    return F.cross_entropy(logits.float(), targets, reduction="sum")


__all__ = [
    "FAMILIES",
    "ModelSpec",
    "build_model",
    "count_params",
    "spec_for",
    "spec_of",
    "token_loss",
    "transformer_blocks",
]
