"""Tensor parallelism (Megatron-style, as torchtitan applies it), by the family's `tp_plan`
(components/models/). For Llama:

In each block the attention's q/k/v and the MLP's gate/up projections are split by output
features (`ColwiseParallel`: each rank computes its heads, its FFN columns) and o/down by input
features (`RowwiseParallel`: partial sums). Every parameter is a DTensor on the tp mesh (whole
ones `Replicate`), so the optimizer, the gradient norm and DCP treat them alike. Under pipeline
parallelism each stage is split the same way over its own tp ranks
(components/parallel/apply.py): the hidden states between stages are plain tensors, whole, or
under sequence parallel each tp rank's part of the sequence (`sequence_in`, `sequence_out`).

Sequence parallel (`train.sequence_parallel`, torchtitan's default; where it applies:
`components.parallel.sequence_parallel`): between the tp regions the residual stream and the
norms are split along the sequence (Shard(1)). The embedding (split by vocabulary) and o/down
reduce-scatter into it, the attention's and MLP's inputs are all-gathered out of it (the same
bytes as two all-reduces), so the norms' activations and the saved residual inputs are 1/tp
each. The head takes the sequence-split hidden states and leaves its logits split by
vocabulary: the cross-entropy runs under `loss_parallel()` (`loss_scope`, forward and
backward) and never gathers them.

Without it: o/down's partial sums are all-reduced (two all-reduces forward per block, and
backward one per colwise projection, whose input's gradient is partial), the embedding and the
norms are computed whole on every rank (`Replicated`), and the head's logits are gathered for
the plain cross-entropy.

fp8: Float8Linear modules take torchao's `Float8ColwiseParallel` / `Float8RowwiseParallel` (and
`PrepareFloat8ModuleInput` under sequence parallel), which cast to fp8 before the collectives;
the ends (never fp8) take the plain styles.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from components.models import spec_of


class Replicated(ParallelStyle):
    """A module computed whole on every rank, its parameters Replicate DTensors: plain tensors
    in become replicated DTensors, the output goes back to a plain tensor. No communication
    forward; backward, its inputs' gradients stay whole (each rank computed the same)."""

    def _apply(self, module: torch.nn.Module, device_mesh: DeviceMesh) -> torch.nn.Module:
        def inputs_in(mod, inputs, mesh):
            return tuple(
                DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
                else x
                for x in inputs
            )

        def output_out(mod, output, mesh):
            return output.to_local() if isinstance(output, DTensor) else output

        return distribute_module(module, device_mesh, input_fn=inputs_in, output_fn=output_out)


def _styles(names: dict[str, str], module: torch.nn.Module, float8: bool, sp: bool) -> dict[str, ParallelStyle]:
    """The ParallelStyles for a family's plan (components/models/; roles "colwise", "rowwise",
    "norm", "gathered" (a region whose input sequence parallel all-gathers; "gathered:<name>"
    when passed as that keyword), "embedding", "head", "replicate") as torchtitan's Llama plan
    has them; `sp`: with sequence parallel and the loss-parallel head."""
    from torchao.float8.float8_linear import Float8Linear

    def linear(name: str, kind: str) -> ParallelStyle:
        seq = {"output_layouts": Shard(1), "use_local_output": False} if sp and kind == "rowwise" else {}
        if float8 and isinstance(module.get_submodule(name), Float8Linear):
            from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

            return Float8ColwiseParallel() if kind == "colwise" else Float8RowwiseParallel(**seq)
        return ColwiseParallel() if kind == "colwise" else RowwiseParallel(**seq)

    def gathered(name: str, kind: str) -> ParallelStyle:  # a region's input, all-gathered from Shard(1)
        if ":" in kind:  # the input passed by keyword
            keyword = kind.split(":", 1)[1]
            layouts = {"input_kwarg_layouts": {keyword: Shard(1)},
                       "desired_input_kwarg_layouts": {keyword: Replicate()}}  # fmt: skip
        else:
            layouts = {"input_layouts": (Shard(1),), "desired_input_layouts": (Replicate(),)}
        if float8 and any(isinstance(m, Float8Linear) for m in module.get_submodule(name).modules()):
            from torchao.float8.float8_tensor_parallel import PrepareFloat8ModuleInput

            return PrepareFloat8ModuleInput(**layouts)
        return PrepareModuleInput(**layouts)

    out: dict[str, ParallelStyle] = {}
    for name, kind in names.items():
        if kind in ("colwise", "rowwise"):
            out[name] = linear(name, kind)
        elif kind.split(":")[0] == "gathered":
            if sp:
                out[name] = gathered(name, kind)
        elif kind == "norm" and sp:
            out[name] = SequenceParallel()
        elif kind == "embedding" and sp:  # split by vocabulary, its partial sums reduce-scattered
            out[name] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False)
        elif kind == "head" and sp:  # the logits split by vocabulary, never gathered
            out[name] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
        elif kind == "head":  # split by vocabulary, the logits gathered
            out[name] = ColwiseParallel(output_layouts=Replicate())
        else:  # "replicate", and without sp the norms and the embedding: computed whole
            out[name] = Replicated()
    return out


def check_divisible(model: torch.nn.Module, tp: int) -> None:
    """Heads, kv heads and FFN columns split evenly over the tp ranks (checked at compose as
    well; here on the live model, whose vocabulary may come from the dataset)."""
    cfg = model.config
    for what, n in (
        ("model.num_heads", cfg.num_attention_heads),
        ("model.num_kv_heads", cfg.num_key_value_heads),
        ("model.ffn_hidden_size", cfg.intermediate_size),
    ):
        if n % tp:
            raise ValueError(f"train.tp={tp} must divide {what}={n}")


def apply_tp(model: torch.nn.Module, tp_mesh: DeviceMesh, sp: bool = False) -> None:
    """Shard the model, or one pipeline stage of it (its blocks, and the ends it holds), in place
    over `tp_mesh` as its family's `tp_plan` says (after the precision conversion, before
    activation checkpointing, compile and FSDP); `sp`: with sequence parallel and a
    loss-parallel head (`components.parallel.sequence_parallel` says where)."""
    from torchao.float8.float8_linear import Float8Linear

    check_divisible(model, tp_mesh.size())
    spec = spec_of(model)
    float8 = any(isinstance(m, Float8Linear) for m in model.modules())
    tied = model.config.tie_word_embeddings
    per_block, ends = spec.tp_plan(tied)
    for block in spec.blocks(model).children():  # a ModuleList, or a stage's ModuleDict
        parallelize_module(block, tp_mesh, _styles(per_block, block, float8, sp))
    held = {name: kind for name, kind in ends.items() if _holds(model, name)}
    if held:
        parallelize_module(model, tp_mesh, _styles(held, model, False, sp))  # the ends are never fp8
    if tied:  # distribute_module gave each its own Parameter: share the embedding's again
        spec.tie_again(model)
    model.loss_parallel = sp
    model.sequence_mesh = tp_mesh if sp else None  # a pipeline stage's hidden states in and out: Shard(1)


def loss_scope(model: torch.nn.Module):
    """Where the loss is computed and backpropagated: inside `loss_parallel()` for a model whose
    head keeps its logits split over the vocabulary (the cross-entropy reduces its max and sum
    over the tp ranks, never gathering the logits), else nothing."""
    import contextlib

    held = getattr(model, "module", model)  # under DDP, the model it wraps
    return loss_parallel() if getattr(held, "loss_parallel", False) else contextlib.nullcontext()


def sequence_in(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A pipeline stage's incoming hidden states: under sequence parallel this tp rank's part of
    the sequence (a plain tensor, as the stage before sent it), made the Shard(1) DTensor the
    blocks take."""
    mesh = getattr(module, "sequence_mesh", None)
    return DTensor.from_local(x, mesh, [Shard(1)], run_check=False) if mesh is not None else x


def sequence_out(x: torch.Tensor) -> torch.Tensor:
    """What a pipeline stage sends on: a sequence-split DTensor's local part (plain tensors cross
    stages), else the tensor."""
    return x.to_local() if isinstance(x, DTensor) else x


def local_loss(loss: torch.Tensor) -> torch.Tensor:
    """A loss-parallel loss is a replicated DTensor: its plain value (the same on every tp rank)."""
    return loss.to_local() if isinstance(loss, DTensor) else loss


def _holds(model: torch.nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True
