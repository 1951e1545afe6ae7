"""The Llama family: the decoder `transformers` builds from the `model` config, and everything
else in the project needs to know about its layout (the `ModelSpec` of components/models/).

Nothing outside components/models/ names one of its module paths (tests/test_layout.py holds
the project to that): tensor parallelism asks `tp_plan`, the pipeline asks `stage`, the planner
`param_tensors`, a non-finite step's culprit `forward_position`, fp8 `head`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

from components.config import ModelConfig

if TYPE_CHECKING:
    import torch
    from torch import nn

# tensor parallelism, as torchtitan applies it to Llama: in each block q/k/v and gate/up split by
# output features (colwise), o and down by input features (rowwise: partial sums, all-reduced);
# the block's norms computed whole on every tp rank
_COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
_ROWWISE = ("self_attn.o_proj", "mlp.down_proj")
_BLOCK_NORMS = ("input_layernorm", "post_attention_layernorm")


def decoder_shape(cfg: ModelConfig, vocab_size: int) -> dict:
    """The Hugging Face config keys a Llama-style decoder's shape fills (Llama's and Mixtral's alike)."""
    return dict(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_seq_len,
        tie_word_embeddings=cfg.tie_embeddings,
        use_cache=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


class Llama:
    """`ModelSpec` of the Llama decoder (`LlamaForCausalLM`)."""

    family = "llama"
    model_type = "llama"  # the Hugging Face config's model_type: how a built model names its family
    head = "lm_head"  # the output head: never fp8 (its logits feed the loss)
    probe_norm = "input_layernorm"  # a norm whose weight dtype says what the forward computes in
    buffer_prefix = "model.rotary_emb."  # its only buffers: the rotary frequencies (never saved)

    hf_class = "LlamaForCausalLM"  # what `build` makes, from `transformers`

    def hf_config(self, cfg: ModelConfig, vocab_size: int):
        from transformers import LlamaConfig

        return LlamaConfig(**decoder_shape(cfg, vocab_size), rope_theta=cfg.rope_theta)

    def build(self, cfg: ModelConfig, vocab_size: int, seed: int | None = None) -> nn.Module:
        """A freshly initialized model in fp32 (master weights stay fp32 whatever the compute
        precision), on the current default device (under `torch.device("meta")`: no storage)."""
        import torch
        import transformers

        if seed is not None:
            torch.manual_seed(seed)
        return getattr(transformers, self.hf_class)(self.hf_config(cfg, vocab_size)).to(torch.float32)

    def blocks(self, model: nn.Module) -> nn.Module:
        """The transformer blocks: a ModuleList, or a pipeline stage's ModuleDict keyed by index."""
        return model.model.layers

    def embeddings(self, model: nn.Module) -> nn.Module:
        return model.model.embed_tokens

    def tp_plan(self, tied: bool) -> tuple[dict[str, str], dict[str, str]]:
        """(each block's submodules, the model's ends) -> a role for components/parallel/tensor.py:
        "colwise" | "rowwise" (the matmuls), "norm", "gathered" (a region's input: the MLP's
        positional, "gathered:hidden_states" the attention's keyword), "embedding", "head"
        (split by vocabulary); a tied head is computed whole ("replicate"), as its embedding is."""
        block = {**dict.fromkeys(_COLWISE, "colwise"), **dict.fromkeys(_ROWWISE, "rowwise")}
        block.update(dict.fromkeys(_BLOCK_NORMS, "norm"))
        block.update({"self_attn": "gathered:hidden_states", "mlp": "gathered"})
        ends = {
            "model.embed_tokens": "replicate" if tied else "embedding",
            "model.norm": "norm",
            self.head: "replicate" if tied else "head",
        }
        return block, ends

    def aux_loss(self, model: nn.Module, output) -> torch.Tensor | None:
        """A loss term the family adds to the token loss (a router's): none."""
        return None

    def expert_load(self, model: nn.Module, output) -> torch.Tensor | None:
        """Tokens each expert took in a forward: no experts."""
        return None

    def tie_again(self, model: nn.Module) -> None:
        """After a layout gave the head its own Parameter: share the embedding's again."""
        model.lm_head.weight = model.model.embed_tokens.weight

    def stage(self, full: nn.Module, layers: range, first: bool, last: bool, autocast: Callable) -> nn.Module:
        return _stage_class()(full, layers, first, last, autocast)

    def rebuild_buffers(self, model: nn.Module, config, device: torch.device) -> None:
        """The rotary frequencies (not saved) of a model built on the meta device, computed again."""
        rotary = model.model.rotary_emb
        model.model.rotary_emb = type(rotary)(config=config).to(device)

    def forward_position(self, name: str) -> tuple[int, int]:
        """Where a module runs in a forward: the embeddings, then each block by its index in the
        whole model (a pipeline stage keeps those names), then the final norm and the head."""
        parts = name.split(".")
        if parts[:2] == ["model", "layers"] and len(parts) > 2 and parts[2].isdigit():
            return 1, int(parts[2])
        return (0, 0) if parts[:2] == ["model", "embed_tokens"] else (2, 0 if parts[:2] == ["model", "norm"] else 1)

    def param_tensors(self, model: ModelConfig) -> list[tuple[str, int, bool]]:
        """(kind, numel, is an fp8-eligible Linear weight) for every parameter tensor `build`
        makes (tests/preflight/test_plan.py holds the two to each other); kinds: embed,
        linear, block_norm, norm, head."""
        from components.precision import fp8_eligible_dims

        h, v = model.hidden_size, model.vocab_size or 0
        kv = model.num_kv_heads * (h // model.num_heads)
        ffn = model.ffn_hidden_size
        block = [(h, h), (h, kv), (h, kv), (h, h), (h, ffn), (h, ffn), (ffn, h)]  # q k v o, gate up down
        out = [("embed", v * h, False)]
        for _ in range(model.num_layers):
            out += [("linear", i * o, fp8_eligible_dims(i, o)) for i, o in block]
            out += [("block_norm", h, False), ("block_norm", h, False)]
        out.append(("norm", h, False))
        if not model.tie_embeddings:
            out.append(("head", v * h, False))
        return out


@functools.cache
def _stage_class() -> type:
    """`LlamaStage`, defined on first use: the planner imports this file without torch."""
    from torch import nn

    class LlamaStage(nn.Module):
        """One pipeline stage of a `LlamaForCausalLM`: a run of its blocks (the embeddings before
        them on the first stage; the final norm and the head after them on the last), under the
        full model's parameter names. In: token ids (first stage) or hidden states; out: hidden
        states, or the logits on the last stage."""

        def __init__(self, full: nn.Module, layers: range, first: bool, last: bool, autocast: Callable):
            super().__init__()
            self.first, self.last, self.config, self._autocast = first, last, full.config, autocast
            self.model = nn.Module()
            if first:
                self.model.embed_tokens = full.model.embed_tokens
            self.model.layers = nn.ModuleDict({str(i): full.model.layers[i] for i in layers})
            if last:
                self.model.norm = full.model.norm
                self.lm_head = full.lm_head
            self.model.rotary_emb = full.model.rotary_emb  # buffers only (not saved)

        def parts(self) -> dict[str, nn.Module]:
            """The modules this stage holds that carry parameters, by their name in the full model."""
            held = {f"model.layers.{k}": block for k, block in self.model.layers.items()}
            if self.first:
                held["model.embed_tokens"] = self.model.embed_tokens
            if self.last:
                held.update({"model.norm": self.model.norm, "lm_head": self.lm_head})
            return held

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            import torch
            from transformers.masking_utils import create_causal_mask

            from components.parallel.tensor import sequence_in, sequence_out

            with self._autocast():
                h = self.model.embed_tokens(x) if self.first else sequence_in(self, x)
                positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
                rotary = self.model.rotary_emb(h, position_ids=positions)
                mask = create_causal_mask(config=self.config, inputs_embeds=h, attention_mask=None,
                                          past_key_values=None, position_ids=positions)  # fmt: skip
                for block in self.model.layers.values():
                    h = block(h, attention_mask=mask, position_embeddings=rotary, position_ids=positions)
                if self.last:
                    return self.lm_head(self.model.norm(h))
                return sequence_out(h)

    return LlamaStage
