"""mixture_reader: blocks/s of training's reader drawing a three-source mixture by weight
against the same reader over the same corpus as one source (no schedule), on the same bytes.

The corpus is made by the real stage (`run_tokenize`) as a mixture of three sources, each
tokenized into a dataset version of its own with the shared tokenizer: the shipped KJV cut
in two halves (two sources) and the shipped CPython standard library, seq_len 64, two shards
per KJV source. Both sides open the same `StreamingBlocks` over the corpus's six train shard
files in the local store (fetched and verified once, before the clock) and run training's
consumer: `BlockSampler.batch` (micro-batch 16, world 1: each batch's (shard, block) pairs,
the gather of its rows, the prefetch request) and a checksum of the batch. The mixture side
draws the sources 0.5 / 0.3 / 0.2 through the low-discrepancy schedule, counting each
source's draws to find its next block; the baseline side is the pre-mixture sampler over all
six shards. Each side reads BENCH_MIX_BLOCKS blocks per run; runs are interleaved
BENCH_MIX_RUNS times; best against best. Target: mixture/single >= 0.95.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from pathlib import Path

from benchmarks.common import CORPUS, ROOT, report

BLOCKS = int(os.environ.get("BENCH_MIX_BLOCKS", "40000"))
RUNS = int(os.environ.get("BENCH_MIX_RUNS", "5"))
MICRO = 16
WEIGHTS = {"kjv-a": 0.5, "kjv-b": 0.3, "pystdlib": 0.2}


def build(tmp: Path):
    """The three-source corpus in a local store: (its train split, opened)."""
    from omegaconf import OmegaConf

    from components.config import SourceConfig, compose
    from components.store import open_store
    from components.stream import open_split
    from components.tokenize.stage import run_tokenize

    lines = CORPUS.read_text().splitlines(keepends=True)
    half = len(lines) // 2
    for name, part in (("kjv-a", lines[:half]), ("kjv-b", lines[half:])):
        (tmp / name).mkdir()
        for i in range(2):  # two files per source: two shards
            (tmp / name / f"part{i}.jsonl").write_text("".join(part[i::2]))
    paths = {"kjv-a": tmp / "kjv-a", "kjv-b": tmp / "kjv-b", "pystdlib": ROOT / "corpus" / "pystdlib.jsonl"}
    over = [f"store.root={tmp / 'store'}", f"store.cache_dir={tmp / 'cache'}", "experiment=tiny-mix"]
    cfg = OmegaConf.to_object(compose(over))
    sources = {n: SourceConfig(paths=[str(p)], shards=2) for n, p in paths.items()}
    sources["pystdlib"] = SourceConfig(paths=[str(paths["pystdlib"])], shards=1, val_fraction=0.2)
    cfg.data = dataclasses.replace(cfg.data, name="mix3", sources=sources, mixture=dict(WEIGHTS))
    store = open_store(cfg.store)
    corpus = run_tokenize(cfg.data, cfg.tokenizer, cfg.model, store).manifest
    blocks = open_split(store, corpus, "train")
    for shard in range(len(blocks.sizes)):
        blocks.block(shard, 0)  # every shard fetched and verified before the clock
    return cfg, blocks


def consume(blocks, mixture) -> tuple[float, int]:
    """(blocks/s over BLOCKS blocks after the first batch, the checksum)."""
    import torch

    from components.train.data import BlockSampler

    sampler = BlockSampler(blocks, MICRO, 1, 1, 0, 0, mixture)
    cpu, checksum = torch.device("cpu"), 0
    sampler.batch(0, cpu)
    t0 = time.perf_counter()
    for k in range(1, BLOCKS // MICRO + 1):
        checksum += int(sampler.batch(k * MICRO, cpu).sum())
    return (BLOCKS // MICRO) * MICRO / (time.perf_counter() - t0), checksum


def main() -> None:
    import torch

    from components.train.data import Mixture

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="bench-mixture-") as tmp:
        cfg, blocks = build(Path(tmp))
        mixture = Mixture.of(blocks, WEIGHTS)
        sources = dict(zip(mixture.names, mixture.shards, strict=True))
        print(f"corpus: {len(blocks)} train blocks in {len(blocks.sizes)} shards, sources (shards) {sources}")
        ours, base = [], []
        for _ in range(RUNS):
            ours.append(consume(blocks, mixture)[0])
            base.append(consume(blocks, None)[0])
        blocks.close()
    pairs = [o / b for o, b in zip(ours, base, strict=True)]
    print(f"runs: mixture {[round(r) for r in ours]}, single source {[round(r) for r in base]} blocks/s")
    print(f"best: mixture {max(ours):,.0f} vs single source {max(base):,.0f} blocks/s; pair ratios {pairs}")
    report("mixture_reader", max(ours), max(base), "blocks/s", runs=RUNS, pair_ratio_min=min(pairs),
           pair_ratio_max=max(pairs))  # fmt: skip


if __name__ == "__main__":
    main()
