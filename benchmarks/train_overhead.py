"""train_overhead: liftoff's training loop (monitoring, agreement on the loss, non-finite checks,
checkpoints, logging; launched through TorchX) vs a bare PyTorch DDP loop on the same model,
data, precision, world size (2 ranks on this host) and threads per process.

Both sides are measured the same way: steady-state tokens/s from per-step timestamps on rank 0,
over 2 ranks x 1 process, and both checkpoint on the same schedule (every CHECKPOINT_INTERVAL =
STEPS/4 steps and at the last) in the same mode (`train.checkpoint_async`: the tiny preset
saves synchronously): liftoff through its Checkpointer (DCP shards, rank state, hashes,
index, the store publish), the bare loop with a plain DCP save of model and optimizer to
local disk (an async one on a gloo group of its own, as liftoff's, each waiting for the one
before). Periodic validation is off on both sides (`train.val_interval=0`; the bare loop has
none). A save at step s blocks between step s's timestamp and step s+1's, so the
timed window runs from step CHECKPOINT_INTERVAL's timestamp to step STEPS's: the first
interval is dropped as warm-up, and the window holds whole checkpoint intervals, each with its
save (everything that blocks, on both sides: the saves at the window's start and inside it; the
last step's save and validation lie after it on both sides, as the first interval's steps lie
before it). Until 2026-12-02 liftoff saved only at the last step, after the window. The runs are
interleaved (ours, bare, ours, bare, ...) RUNS times; the ratio is best / best and the spread of
the per-pair ratios is reported, because single runs on a shared 2-core VM move by +-10%.
Target ratio >= 0.95.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from benchmarks.common import CORPUS, TRAIN_SHAPE, report_interleaved
from benchmarks.common import steady_rate as rate_over

STEPS = int(os.environ.get("BENCH_TRAIN_STEPS", "40"))
RUNS = int(os.environ.get("BENCH_TRAIN_RUNS", "3"))
CHECKPOINT_INTERVAL = max(1, STEPS // 4)
WINDOW = (CHECKPOINT_INTERVAL, STEPS // CHECKPOINT_INTERVAL * CHECKPOINT_INTERVAL)  # timed: steps in (start, end]
SHAPE = [
    *TRAIN_SHAPE,
    f"train.steps={STEPS}",
    "train.warmup_steps=2",
    f"train.checkpoint_interval={CHECKPOINT_INTERVAL}",
    "train.val_interval=0",  # the bare loop validates nothing
    "train.log_interval=10",
    "train.resume=never",
    # the bare loop's setting: 2 ranks x 1 process, fp32, no activation checkpointing
    "cluster.nodes=2",
    "cluster.procs_per_node=1",
    "train.precision=fp32",
    "train.activation_checkpointing=off",
]


def bare_loop(store_root: str, cache_dir: str, dataset: str) -> None:
    """One rank of the bare DDP loop (run under torchrun); rank 0 prints its tokens/s. It reads the
    train split as liftoff's workers do, through `open_split` (shards fetched from the store into
    its own cache, verified, prefetched), so the data path is not part of the difference."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.nn.parallel import DistributedDataParallel

    from components.config import compose, defaults
    from components.models import build_model
    from components.optimizer import build_optimizer
    from components.store import Ref, open_store
    from components.stream import open_split
    from components.train.data import BlockSampler

    cfg = OmegaConf.to_object(compose([f"data.paths=[{CORPUS}]", *SHAPE]))
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    store = open_store(defaults("store", root=store_root, cache_dir=cache_dir))
    blocks = open_split(store, store.manifest(Ref.parse(dataset)), "train", cfg.data.cache_gb)
    sampler = BlockSampler(blocks, cfg.train.micro_batch_size, 1, world, rank, cfg.train.seed)
    model = DistributedDataParallel(build_model(cfg.model, 1024, cfg.train.seed), broadcast_buffers=False)
    opt = build_optimizer(model, cfg.train)
    save_group = dist.new_group(backend="gloo") if cfg.train.checkpoint_async else None  # off DDP's stream
    stamps, saving = {}, None  # step -> its timestamp; the async save in flight
    for step in range(1, STEPS + 1):
        batch = sampler.batch((step - 1) * sampler.samples_per_micro_batch, torch.device("cpu"))
        logits = model(input_ids=batch[:, :-1]).logits
        F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        stamps[step] = time.perf_counter()
        if step % CHECKPOINT_INTERVAL == 0 or step == STEPS:  # liftoff's schedule, after the step's stamp
            if saving is not None:
                saving.result()
            state = dict(zip(("model", "optim"), get_state_dict(model, opt), strict=True))
            if save_group is None:
                dcp.save(state, checkpoint_id=f"{cache_dir}/bare-{step}")
            else:
                saving = dcp.async_save(state, checkpoint_id=f"{cache_dir}/bare-{step}", process_group=save_group)
    if saving is not None:
        saving.result()
    if rank == 0:
        print(json.dumps({"bare_tokens_per_s": steady_rate(stamps, batch[:, 1:].numel() * world)}))
    blocks.close()
    dist.destroy_process_group()


def steady_rate(stamps: dict[int, float], tokens_per_step: int) -> float:
    """tokens/s over the steps in WINDOW from {step: the time it ended}: whole checkpoint intervals."""
    return rate_over(stamps, tokens_per_step, WINDOW)


def run_bare(store_root: str, cache_dir: str, dataset: str) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // 2))}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
        + ["-m", "benchmarks.train_overhead", "--bare", store_root, cache_dir, dataset],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        check=True,
    )
    return next(json.loads(ln)["bare_tokens_per_s"] for ln in proc.stdout.splitlines() if "bare_tokens_per_s" in ln)


def main() -> None:
    from components.config import compose, defaults
    from components.plots import read_records
    from components.store import open_store
    from components.tokenize.stage import run_tokenize
    from components.train.stage import run_train

    with tempfile.TemporaryDirectory() as tmp:
        cfg = OmegaConf.to_object(compose([f"data.paths=[{CORPUS}]", f"train.run_dir={tmp}/runs", *SHAPE]))
        cfg.store = defaults("store", root=f"{tmp}/store", cache_dir=f"{tmp}/cache")
        store = open_store(cfg.store)
        ds = run_tokenize(cfg.data, cfg.tokenizer, cfg.model, store)
        world = cfg.cluster.nodes * cfg.cluster.procs_per_node
        ours_runs, bare_runs = [], []
        for attempt in range(RUNS):
            cfg.train.run_dir = f"{tmp}/runs-{attempt}"
            result = run_train(
                str(ds.manifest.ref), cfg.model, cfg.train, cfg.cluster, cfg.store, store, cache_gb=cfg.data.cache_gb
            )
            steps, _ = read_records(result.metrics)  # rank 0's metrics.jsonl, as the store hands it back
            tokens = cfg.train.micro_batch_size * cfg.data.seq_len * world
            ours_runs.append(steady_rate({s["step"]: s["time"] for s in steps}, tokens))
            bare_runs.append(run_bare(f"{tmp}/store", f"{tmp}/bare-cache-{attempt}", str(ds.manifest.ref)))
    report_interleaved(
        "train_overhead",
        ours_runs,
        bare_runs,
        ("liftoff", "bare DDP"),
        world=world,
        checkpoint_interval=CHECKPOINT_INTERVAL,
        checkpoint_async=cfg.train.checkpoint_async,
        window_steps=list(WINDOW),
    )


if __name__ == "__main__":
    if "--bare" in sys.argv:
        i = sys.argv.index("--bare")
        bare_loop(*sys.argv[i + 1 : i + 4])
    else:
        main()
