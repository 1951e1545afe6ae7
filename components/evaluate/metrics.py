"""Held-out metrics: perplexity, bits per byte, a unigram baseline, throughput, samples."""

from __future__ import annotations

import math
import time

import numpy as np
import torch

from components.blocks import batches, first_blocks


def token_byte_lengths(tokenizer, vocab_size: int) -> np.ndarray:
    """UTF-8 bytes each token stands for (special tokens: 0), for bits per byte.

    Byte-level BPE tokens are strings of one char per byte; other tokenizers are decoded.
    """
    from tokenizers import pre_tokenizers

    byte_level = isinstance(tokenizer.backend_tokenizer.pre_tokenizer, pre_tokenizers.ByteLevel)
    special = set(tokenizer.all_special_ids)
    lengths = np.zeros(vocab_size, dtype=np.int64)
    for i in range(min(vocab_size, len(tokenizer))):
        if i in special:
            continue
        tok = tokenizer.convert_ids_to_tokens(i)
        lengths[i] = len(tok) if byte_level else len(tokenizer.decode([i]).encode())
    return lengths


@torch.no_grad()
def perplexity(model, blocks, n_blocks: int, batch_size: int, byte_lengths: np.ndarray) -> dict[str, float]:
    """Mean loss, perplexity, bits per byte and inference tokens/s over the val blocks."""
    nats = 0.0
    tokens = nbytes = 0
    elapsed = 0.0
    for batch in batches(blocks, n_blocks, batch_size):
        t0 = time.perf_counter()
        logits = model(input_ids=batch[:, :-1]).logits.float()
        elapsed += time.perf_counter() - t0
        targets = batch[:, 1:]
        nats += float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum"))
        tokens += targets.numel()
        nbytes += int(byte_lengths[targets.numpy()].sum())
    return perplexity_metrics(nats, tokens, nbytes, elapsed)


def perplexity_metrics(nats: float, tokens: int, nbytes: int, elapsed: float) -> dict[str, float]:
    """The val metrics from summed nats, target tokens and their UTF-8 bytes, and forward seconds."""
    loss = nats / tokens
    return {
        "val_loss": loss,
        "val_perplexity": math.exp(loss),
        "val_bits_per_byte": nats / math.log(2) / nbytes,
        "val_tokens": float(tokens),
        "inference_tokens_per_s": tokens / elapsed,
    }


SOURCE_METRICS = ("val_loss", "val_perplexity", "val_bits_per_byte")  # measured per source of a mixture


def mixture_metrics(per_source: dict[str, dict[str, float]], weights: dict[str, float]) -> dict[str, float]:
    """A mixture's val metrics: each source's own (`val_loss/<source>`, ...) and the mixture's,
    the sources weighed by the weights the model trained with (a token drawn as training drew
    them): loss = sum w_i loss_i, bits per byte = sum w_i nats_i / (ln 2 sum w_i bytes_i), both
    per token of each source's val blocks."""
    out = {f"{k}/{name}": m[k] for name, m in per_source.items() for k in SOURCE_METRICS}
    total = sum(weights.values())
    w = {name: weights[name] / total for name in per_source}
    loss = sum(w[n] * m["val_loss"] for n, m in per_source.items())
    bytes_per_token = {n: m["val_loss"] / math.log(2) / m["val_bits_per_byte"] for n, m in per_source.items()}
    tokens = sum(m["val_tokens"] for m in per_source.values())
    seconds = sum(m["val_tokens"] / m["inference_tokens_per_s"] for m in per_source.values())
    out.update(
        val_loss=loss,
        val_perplexity=math.exp(loss),
        val_bits_per_byte=loss / math.log(2) / sum(w[n] * b for n, b in bytes_per_token.items()),
        val_tokens=float(tokens),
        inference_tokens_per_s=tokens / seconds,
    )
    return out


def unigram_perplexity(train_blocks, val, n_blocks: int, vocab_size: int, max_train_blocks: int = 200_000) -> float:
    """Perplexity of predicting each val token from train token frequencies alone (add-one
    smoothed): the bar any trained model should clear. Counts the first `max_train_blocks`
    train blocks, in shard order: a bounded read of a dataset of any size."""
    counts = np.ones(vocab_size, dtype=np.float64)
    for i in range(min(len(train_blocks), max_train_blocks)):
        counts += np.bincount(train_blocks[i][1:], minlength=vocab_size)[:vocab_size]
    logp = np.log(counts / counts.sum())
    n = first_blocks(val, n_blocks)
    targets = np.concatenate([val[i][1:] for i in range(n)]).astype(np.int64)
    return float(math.exp(-logp[targets].mean()))


@torch.no_grad()
def greedy_samples(model, tokenizer, prompts: list[str], max_new_tokens: int, device=None, in_step=False) -> list[dict]:
    """`in_step`: a model sharded over ranks, every rank generating the same (each forward is a
    collective: no rank may stop early)."""
    out = []
    for prompt in prompts:
        ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)], device=device)
        gen = model.generate(
            ids,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.eos_token_id,
            eos_token_id=None,
            **({"synced_gpus": True} if in_step else {}),
        )
        out.append({"prompt": prompt, "continuation": tokenizer.decode(gen[0, ids.shape[1] :])})
    return out
