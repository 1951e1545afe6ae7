"""train_overhead: tokens/s of liftoff's training loop (monitoring, checks, logging and all,
launched through TorchX) vs a bare PyTorch loop on the same model, data, precision and thread
count. Both are wall-clock over the same steady-state steps (the last three quarters), so
everything the loop does between steps counts; each side runs twice, interleaved, and the
better run counts (this 2-core VM's noise is larger than the effect). Target ratio >= 0.95.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from benchmarks.common import CORPUS, report

STEPS = int(os.environ.get("BENCH_TRAIN_STEPS", "40"))
SHAPE = [
    "model.hidden_size=256",
    "model.num_layers=4",
    "model.num_heads=4",
    "model.num_kv_heads=4",
    "model.ffn_hidden_size=768",
    "train.micro_batch_size=16",
    f"train.steps={STEPS}",
    "train.warmup_steps=2",
    f"train.checkpoint_interval={STEPS}",
    "train.log_interval=10",
    "train.resume=never",
    # the bare loop's setting: one process, fp32, no activation checkpointing
    "cluster.nodes=1",
    "train.precision=fp32",
    "train.activation_checkpointing=false",
]


def bare_loop(cfg, data_dir: Path, threads: int) -> float:
    from components.tokenize.blocks import open_token_blocks
    from components.train.data import BlockSampler
    from components.train.model import build_model
    from components.train.optim import build_optimizer

    torch.set_num_threads(threads)
    blocks = open_token_blocks(data_dir, "train")
    sampler = BlockSampler(blocks, cfg.train.micro_batch_size, 1, 1, 0, cfg.train.seed)
    model = build_model(cfg.model, 1024, cfg.train.seed)
    opt = build_optimizer(model, cfg.train)
    stamps = []
    for step in range(STEPS):
        batch = sampler.batch(step * sampler.samples_per_micro_batch, torch.device("cpu"))
        logits = model(input_ids=batch[:, :-1]).logits
        F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        stamps.append(time.perf_counter())
    return steady_rate(stamps, batch[:, 1:].numel())


def steady_rate(stamps: list[float], tokens_per_step: int) -> float:
    first = STEPS // 4
    return tokens_per_step * (len(stamps) - 1 - first) / (stamps[-1] - stamps[first])


def main() -> None:
    from components.config import StoreConfig, compose
    from components.store import open_store
    from components.tokenize.stage import run_tokenize
    from components.train.report import read_records
    from components.train.stage import run_train

    with tempfile.TemporaryDirectory() as tmp:
        cfg = OmegaConf.to_object(compose([f"data.paths=[{CORPUS}]", f"train.run_dir={tmp}/runs", *SHAPE]))
        cfg.store = StoreConfig(root=f"{tmp}/store", cache_dir=f"{tmp}/cache")
        store = open_store(cfg.store)
        ds = run_tokenize(cfg.data, cfg.tokenizer, cfg.model, store)
        threads = max(1, os.cpu_count() or 1)
        ours_runs, bare_runs = [], []
        for attempt in range(2):
            cfg.train.run_dir = f"{tmp}/runs-{attempt}"
            result = run_train(str(ds.manifest.ref), cfg.model, cfg.train, cfg.cluster, cfg.store, store)
            steps, _ = read_records(result.run_dir / "metrics.jsonl")
            ours_runs.append(steady_rate([s["time"] for s in steps], cfg.train.micro_batch_size * cfg.data.seq_len))
            bare_runs.append(bare_loop(cfg, ds.path, threads))
        ours, bare = max(ours_runs), max(bare_runs)
        print(f"runs: liftoff {[round(r) for r in ours_runs]}, bare {[round(r) for r in bare_runs]} tokens/s")
    print(f"liftoff step: {ours:,.0f} tokens/s; bare PyTorch loop: {bare:,.0f} tokens/s ({threads} threads)")
    report("train_overhead", ours, bare, "tokens/s")


if __name__ == "__main__":
    main()
