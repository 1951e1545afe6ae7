"""The Llama-style decoder, built from the `model` config with `transformers`."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from components.config import ModelConfig


def llama_config(cfg: ModelConfig, vocab_size: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_seq_len,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_embeddings,
        use_cache=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def build_model(cfg: ModelConfig, vocab_size: int, seed: int) -> LlamaForCausalLM:
    """A freshly initialized model in fp32 (master weights stay fp32 whatever the compute precision)."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config(cfg, vocab_size))
    return model.to(torch.float32)


def transformer_blocks(model: torch.nn.Module) -> torch.nn.ModuleList:
    return model.model.layers


def count_params(model: torch.nn.Module, exclude_embeddings: bool = False) -> int:
    n = sum(p.numel() for p in model.parameters())
    if exclude_embeddings:
        n -= model.get_input_embeddings().weight.numel()
    return n
