"""The tokenizer: a pretrained one by name or path, or a byte-level BPE trained here."""

from __future__ import annotations

import hashlib
from pathlib import Path

from components.config import TokenizerConfig, from_hub

EOS = "<|endoftext|>"


def tokenizer_identity(cfg: TokenizerConfig) -> str:
    """What determines the tokenizer, for the dataset fingerprint: a hub repo at its
    revision, a local directory by the sha256 of its files, or the BPE's settings."""
    if from_hub(cfg):
        return f"pretrained:{cfg.pretrained}@{cfg.revision}"
    if cfg.pretrained:
        root = Path(cfg.pretrained).expanduser()
        if not root.is_dir():
            raise ValueError(f"tokenizer.pretrained={cfg.pretrained}: no such directory")
        h = hashlib.sha256()
        for f in sorted(p for p in root.rglob("*") if p.is_file()):
            h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes())
        return f"pretrained-dir:{h.hexdigest()}"
    return f"bpe:v2:vocab={cfg.vocab_size}:min_frequency={cfg.min_frequency}:sample_mb={cfg.sample_mb}"


def load_pretrained(cfg: TokenizerConfig):
    """A fast tokenizer (a repo or directory with tokenizer.json) by hub name or local path."""
    from transformers import PreTrainedTokenizerFast

    try:
        where = str(Path(cfg.pretrained).expanduser()) if not from_hub(cfg) else cfg.pretrained
        tok = PreTrainedTokenizerFast.from_pretrained(where, revision=cfg.revision if from_hub(cfg) else None)
    except (OSError, ValueError) as e:
        raise ValueError(f"tokenizer.pretrained={cfg.pretrained}: cannot load a fast tokenizer: {e}") from None
    if tok.eos_token_id is None:
        raise ValueError(f"tokenizer.pretrained={cfg.pretrained} has no EOS token to separate documents")
    return tok


def train_bpe(texts, cfg: TokenizerConfig):
    """A byte-level BPE (GPT-2 style: lossless on any UTF-8) trained on the given texts."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        min_frequency=cfg.min_frequency,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, unk_token=None)


def save_tokenizer(tok, out: Path) -> None:
    """Files that `transformers.AutoTokenizer.from_pretrained(out)` loads."""
    tok.save_pretrained(str(out))
