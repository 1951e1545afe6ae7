"""tokenize: end-to-end stage throughput vs raw `tokenizers.encode_batch`, same text and processes.

The corpus is replicated (each copy made distinct so dedup keeps it) to a few MB. Both sides
use a tokenizer trained once beforehand (`tokenizer.pretrained=<dir>`), so the stage's time
is loading, cleaning, splitting, tokenizing, packing, saving and publishing; the baseline's is
reading the JSONL and `encode_batch` in a process pool. Target ratio >= 0.8.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path

from omegaconf import OmegaConf

from benchmarks.common import CORPUS, report

COPIES = int(os.environ.get("BENCH_TOKENIZE_COPIES", "40"))
PROCS = int(os.environ.get("BENCH_TOKENIZE_PROCS", str(os.cpu_count() or 1)))


def _encode_chunk(args) -> int:
    tok_file, texts = args
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tok_file)
    return sum(len(e.ids) + 1 for e in tok.encode_batch(texts, add_special_tokens=False))


def raw_tokens_per_second(src: Path, tok_file: str) -> float:
    t0 = time.perf_counter()
    texts = [json.loads(line)["text"] for line in src.read_text().splitlines()]
    chunks = [(tok_file, texts[i::PROCS]) for i in range(PROCS)]
    with mp.get_context("fork").Pool(PROCS) as pool:
        tokens = sum(pool.map(_encode_chunk, chunks))
    return tokens / (time.perf_counter() - t0)


def main() -> None:
    from components.config import compose, defaults
    from components.store import open_store
    from components.tokenize.stage import run_tokenize

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        src = tmp / "corpus.jsonl"
        lines = CORPUS.read_text().splitlines()
        with open(src, "w") as f:
            for copy in range(COPIES):
                for line in lines:
                    doc = json.loads(line)
                    f.write(json.dumps({"text": f"{doc['text']} ({copy})"}) + "\n")
        size_mb = src.stat().st_size / 1e6
        # train the tokenizer once, then both sides load it
        base = OmegaConf.to_object(compose([f"data.paths=[{CORPUS}]"]))
        base.store = defaults("store", root=str(tmp / "s0"), cache_dir=str(tmp / "c0"))
        first = run_tokenize(base.data, base.tokenizer, base.model, open_store(base.store))
        tok_dir = first.path / "tokenizer"
        cfg = OmegaConf.to_object(
            compose([f"data.paths=[{src}]", f"tokenizer.pretrained={tok_dir}", f"data.num_proc={PROCS}"])
        )
        cfg.store = defaults("store", root=str(tmp / "s1"), cache_dir=str(tmp / "c1"))
        t0 = time.perf_counter()
        result = run_tokenize(cfg.data, cfg.tokenizer, cfg.model, open_store(cfg.store))
        stage_seconds = time.perf_counter() - t0
        tokens = sum(s["tokens"] for s in result.stats["splits"].values())
        ours = tokens / stage_seconds
        raw = raw_tokens_per_second(src, str(tok_dir / "tokenizer.json"))
    print(f"corpus {size_mb:.1f} MB, {tokens} tokens, {PROCS} processes", file=sys.stderr)
    print(f"stage end to end: {ours:,.0f} tokens/s ({stage_seconds:.2f}s); raw encode_batch: {raw:,.0f} tokens/s")
    report("tokenize", ours, raw, "tokens/s", corpus_mb=round(size_mb, 1), processes=PROCS)


if __name__ == "__main__":
    main()
