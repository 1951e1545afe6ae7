"""Tensor parallelism (Megatron-style, as torchtitan applies it), by the family's `tp_plan`
(components/models/). For Llama:

In each block the attention's q/k/v and the MLP's gate/up projections are split by output
features (`ColwiseParallel`: each rank computes its heads, its FFN columns) and o/down by input
features (`RowwiseParallel`: partial sums, all-reduced): two all-reduces forward per block
over the `tp` mesh dimension, and backward one per colwise projection (each takes the whole
input, so each all-reduces its input's gradient). The output head is split by vocabulary and
its logits gathered, so the loss is the plain cross-entropy on full logits. Embeddings and
RMSNorms stay whole, their parameters replicated DTensors on the same mesh (`Replicated`),
so every parameter is a DTensor on one mesh: the optimizer, the gradient norm and DCP treat
them alike. Under pipeline parallelism each stage is split the same way over its own tp ranks
(components/parallel/apply.py): the hidden states between stages are whole, plain tensors.
Sequence parallelism of the norms and a loss-parallel head are not built: the norms'
activations are whole on every rank (the planner counts them so).

fp8: Float8Linear modules take torchao's `Float8ColwiseParallel` / `Float8RowwiseParallel`,
which cast to fp8 before the collectives; the head (never fp8) takes the plain styles.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

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


def _styles(names: dict[str, str], module: torch.nn.Module, float8: bool) -> dict[str, ParallelStyle]:
    """The ParallelStyles for a family's plan (components/models/: "colwise", "rowwise",
    "replicate", "head"): fp8 Linears take torchao's float8 styles, which cast before the
    collectives."""
    from torchao.float8.float8_linear import Float8Linear

    def linear(name: str, kind: str) -> ParallelStyle:
        if float8 and isinstance(module.get_submodule(name), Float8Linear):
            from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

            return Float8ColwiseParallel() if kind == "colwise" else Float8RowwiseParallel()
        return ColwiseParallel() if kind == "colwise" else RowwiseParallel()

    out: dict[str, ParallelStyle] = {}
    for name, kind in names.items():
        if kind == "replicate":
            out[name] = Replicated()
        elif kind == "head":  # split by vocabulary, the logits gathered
            out[name] = ColwiseParallel(output_layouts=Replicate())
        else:
            out[name] = linear(name, kind)
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


def apply_tp(model: torch.nn.Module, tp_mesh: DeviceMesh) -> None:
    """Shard the model, or one pipeline stage of it (its blocks, and the ends it holds), in place
    over `tp_mesh` as its family's `tp_plan` says (after the precision conversion, before
    activation checkpointing, compile and FSDP)."""
    from torchao.float8.float8_linear import Float8Linear

    check_divisible(model, tp_mesh.size())
    spec = spec_of(model)
    float8 = any(isinstance(m, Float8Linear) for m in model.modules())
    tied = model.config.tie_word_embeddings
    per_block, ends = spec.tp_plan(tied)
    for block in spec.blocks(model).children():  # a ModuleList, or a stage's ModuleDict
        parallelize_module(block, tp_mesh, _styles(per_block, block, float8))
    held = {name: kind for name, kind in ends.items() if _holds(model, name)}
    if held:
        parallelize_module(model, tp_mesh, _styles(held, model, False))  # the ends are never fp8
    if tied:  # distribute_module gave each its own Parameter: share the embedding's again
        spec.tie_again(model)


def _holds(model: torch.nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True
