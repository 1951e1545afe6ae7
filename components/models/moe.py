"""The mixture-of-experts family (`model.family=moe`): a Mixtral-style decoder, Hugging Face's
`MixtralForCausalLM`. Each block's MLP is `model.num_experts` expert MLPs of
`model.ffn_hidden_size`; a linear router sends each token to the `model.experts_per_token` with the
highest softmax weights (renormalized over those), and the load-balancing loss of Switch /
Mixtral (the fraction of tokens each expert takes times its mean router probability, summed,
times the number of experts) is added to the token loss times `model.router_aux_loss_coef`.

It trains under DDP and FSDP (each rank holds its shard of every expert: no expert parallelism,
no TP or PP; the config rules say so), its export is a plain `MixtralForCausalLM`, the planner
counts every expert for memory and `experts_per_token` of them for FLOPs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from components.config import ModelConfig
from components.models.llama import Llama, decoder_shape

if TYPE_CHECKING:
    import torch
    from torch import nn


class Moe(Llama):
    """`ModelSpec` of the Mixtral decoder: Llama's attention, norms, embeddings and head (the same
    module paths), a routed MLP."""

    family = "moe"
    model_type = "mixtral"

    hf_class = "MixtralForCausalLM"

    def hf_config(self, cfg: ModelConfig, vocab_size: int):
        from transformers import MixtralConfig

        return MixtralConfig(
            **decoder_shape(cfg, vocab_size),
            rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
            num_local_experts=cfg.num_experts,
            num_experts_per_tok=cfg.experts_per_token,
            router_aux_loss_coef=cfg.router_aux_loss_coef,
            output_router_logits=True,  # the forward returns the router's logits and its aux loss
        )

    def tp_plan(self, tied: bool):
        raise ValueError("model.family=moe has no tensor-parallel plan (the config rules refuse train.tp > 1)")

    def stage(self, full, layers, first, last, autocast):
        raise ValueError("model.family=moe has no pipeline stages (the config rules refuse train.pp > 1)")

    def aux_loss(self, model: nn.Module, output) -> torch.Tensor | None:
        """The router's load-balancing loss times its coefficient, to add to the token loss."""
        if output.aux_loss is None:
            return None
        return output.aux_loss * _config(model).router_aux_loss_coef

    def expert_load(self, model: nn.Module, output) -> torch.Tensor | None:
        """Tokens routed to each expert in this forward, summed over the blocks: (num_experts,)."""
        import torch

        logits = output.router_logits  # per block: (tokens, num_experts)
        if not logits:
            return None
        k = _config(model).num_experts_per_tok
        picked = torch.cat([torch.topk(x.detach(), k, dim=-1).indices.flatten() for x in logits])
        return torch.bincount(picked, minlength=logits[0].shape[-1]).float()

    def param_tensors(self, model: ModelConfig) -> list[tuple[str, int, bool]]:
        """Llama's tensors with each block's MLP replaced by the router ("router", experts x
        hidden) and the experts' stacked weights ("expert": gate and up, down; all experts')."""
        h, f, e = model.hidden_size, model.ffn_hidden_size, model.num_experts
        out = super().param_tensors(model)
        per_block = 9  # Llama's: q k v o gate up down, two norms
        blocks = [t for t in out if t[0] in ("linear", "block_norm")]
        ends = [t for t in out if t[0] not in ("linear", "block_norm")]
        moe_blocks = []
        for i in range(model.num_layers):
            attention = blocks[i * per_block : i * per_block + 4]
            norms = blocks[i * per_block + 7 : i * per_block + 9]
            moe_blocks += attention + [("router", e * h, False), ("expert", e * 2 * f * h, False),
                                       ("expert", e * h * f, False)] + norms  # fmt: skip
        embed = [t for t in ends if t[0] == "embed"]
        rest = [t for t in ends if t[0] != "embed"]
        return embed + moe_blocks + rest


def _config(model: nn.Module):
    return getattr(model, "module", model).config  # under DDP, the model it wraps
