"""Tensor parallelism (Megatron-style, as torchtitan applies it) on the Llama decoder.

In each block the attention's q/k/v and the MLP's gate/up projections are split by output
features (`ColwiseParallel`: each rank computes its heads, its FFN columns) and o/down by input
features (`RowwiseParallel`: partial sums, all-reduced): two all-reduces forward per block
over the `tp` mesh dimension, and backward one per colwise projection (each takes the whole
input, so each all-reduces its input's gradient). The output head is split by vocabulary and
its logits gathered, so the loss is the plain cross-entropy on full logits. Embeddings and
RMSNorms stay whole, their parameters replicated DTensors on the same mesh (`Replicated`),
so every parameter is a DTensor on one mesh: the optimizer, the gradient norm and DCP treat
them alike. Under pipeline parallelism each stage is split the same way over its own tp ranks
(components/train/parallel.py): the hidden states between stages are whole, plain tensors.
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

from components.train.model import transformer_blocks

COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROWWISE = ("self_attn.o_proj", "mlp.down_proj")
NORMS = ("input_layernorm", "post_attention_layernorm")


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


def tp_plan(block: torch.nn.Module, float8: bool) -> dict[str, ParallelStyle]:
    if float8:
        from torchao.float8.float8_linear import Float8Linear
        from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

        def styles(name: str):
            fp8 = isinstance(block.get_submodule(name), Float8Linear)
            return (Float8ColwiseParallel, Float8RowwiseParallel) if fp8 else (ColwiseParallel, RowwiseParallel)
    else:

        def styles(name: str):
            return ColwiseParallel, RowwiseParallel

    plan: dict[str, ParallelStyle] = {name: styles(name)[0]() for name in COLWISE}
    plan.update({name: styles(name)[1]() for name in ROWWISE})
    plan.update({name: Replicated() for name in NORMS})
    return plan


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
    """Shard the model, or one pipeline stage of it (a `StageChunk`: its blocks, and the ends it
    holds), in place over `tp_mesh` (after the precision conversion, before activation
    checkpointing, compile and FSDP)."""
    from torchao.float8.float8_linear import Float8Linear

    check_divisible(model, tp_mesh.size())
    float8 = any(isinstance(m, Float8Linear) for m in model.modules())
    for block in transformer_blocks(model).children():  # a ModuleList, or a stage's ModuleDict
        parallelize_module(block, tp_mesh, tp_plan(block, float8))
    tied = model.config.tie_word_embeddings
    head = Replicated() if tied else ColwiseParallel(output_layouts=Replicate())  # gathered logits
    ends = {"model.embed_tokens": Replicated(), "model.norm": Replicated(), "lm_head": head}
    held = {name: style for name, style in ends.items() if _holds(model, name)}
    if held:
        parallelize_module(model, tp_mesh, held)
    if tied:  # distribute_module gave each its own Parameter: share the embedding's again
        model.lm_head.weight = model.model.embed_tokens.weight


def _holds(model: torch.nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True
