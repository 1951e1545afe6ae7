"""stream_reader: steady-state blocks/s of the streaming reader (`open_split` ->
`StreamingBlocks`: shards fetched from S3 over loopback HTTP, sha256-verified, prefetched,
LRU-evicted) vs the local mmap reader (the same shard files opened with `ShardFile` from
local disk, no store), both iterating the same global sample order through the same consumer.

The dataset is made by the real stage (`run_tokenize`) from a generated multi-file corpus
(the shipped corpus replicated, each copy made distinct so dedup keeps it, cut into
`data.shards` files), one shard per file, seq_len 2048 (blocks of 2049 uint16 tokens), straight
into an S3 bucket on moto's server. moto runs in a child process, as MinIO would run beside
the trainer rather than inside it: in this process its request handling would share the GIL
with the consumer. The local side gets the same `train.arrow` files fetched once, untimed.
`data.cache_gb` is below the train split's size, so the streaming side evicts while it reads.

The consumer (identical on both sides) is training's: `BlockSampler.batch` (world 1, the
run's global order; it collates the micro-batch and asks for the next shard in the order to
be prefetched), a checksum of the batch (the two sides must read the same tokens), and a
fixed stand-in for a training step: one fp32 512x512 matmul on one torch thread (~3 ms on the
2-core VM; a real step on a GPU takes far longer per micro-batch, so this is a hard case for
prefetch). Prefetch exists to hide a shard's fetch behind the steps that read the shard
before it; without the stand-in there is nothing to hide it behind, so the raw (no compute)
ratio is reported beside the target one. One torch thread leaves the other core to the fetch
and to moto; on a GPU node the host is mostly idle during a step.

Steady state: the clock starts after the first micro-batch (the first shard's cold fetch on
the streaming side; on the local side the first page faults) and stops after the last of one
epoch; everything the consumer waits for in between is counted on both sides (fetches it
catches up with, verification, eviction, opening each shard's map, collation). The cold
figures (construction and the first batch included) are reported too. Each configuration
runs BENCH_STREAM_RUNS times, interleaved local/streaming, each streaming run on an empty
cache; the figures are medians. Target: streaming/local >= 0.5 with the step stand-in.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

from benchmarks.common import CORPUS, report

SHARDS = int(os.environ.get("BENCH_STREAM_SHARDS", "8"))
COPIES = int(os.environ.get("BENCH_STREAM_COPIES", "48"))  # ~2.5 MB of train blocks per shard at 8 shards
SEQ_LEN = int(os.environ.get("BENCH_STREAM_SEQ_LEN", "2048"))
CACHE_GB = float(os.environ.get("BENCH_STREAM_CACHE_GB", "0.01"))  # ~10.7 MB: under half the train split
MICRO = int(os.environ.get("BENCH_STREAM_MICRO", "8"))
MATMUL = int(os.environ.get("BENCH_STREAM_MATMUL", "512"))
RUNS = int(os.environ.get("BENCH_STREAM_RUNS", "3"))
SEED = 0
CHILD = """
import sys, time
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer(ip_address="127.0.0.1", port=int(sys.argv[1]), verbose=False)
server.start()
time.sleep(1e9)
"""


def start_s3() -> tuple[subprocess.Popen, str]:
    """moto's S3 server in a child process on a free loopback port; (process, host:port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tempfile.TemporaryFile()  # its request log; shown only if it dies
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(port)], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"moto server exited with {proc.returncode}: {log.read()[-2000:].decode()}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return proc, f"127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("moto server did not start within 60 s")


def write_corpus(root: Path) -> list[Path]:
    """COPIES distinct copies of the shipped corpus, cut into SHARDS files of consecutive documents."""
    lines = CORPUS.read_text().splitlines()
    docs = [json.dumps({"text": f"{json.loads(ln)['text']} ({c})"}) for c in range(COPIES) for ln in lines]
    paths = []
    for i, part in enumerate(np.array_split(np.arange(len(docs)), SHARDS)):
        paths.append(root / f"part-{i:03d}.jsonl")
        paths[-1].write_text("".join(docs[k] + "\n" for k in part))
    return paths


class LocalShards:
    """The baseline: the same shard files, memory-mapped from local disk with ShardFile; no
    store, no cache, nothing to fetch (so `prefetch` has nothing to do)."""

    def __init__(self, paths: list[Path], block_len: int):
        from components.blocks import ShardFile

        self.files = [ShardFile(p, block_len) for p in paths]
        self.sizes = [len(f) for f in self.files]

    def __len__(self) -> int:
        return sum(self.sizes)

    def block(self, shard: int, j: int) -> np.ndarray:
        return self.files[shard][j]  # a view: the collate's np.stack copies it

    def prefetch(self, shard: int) -> None:
        pass

    def close(self) -> None:
        for f in self.files:
            f.close()


class Step:
    """The training-step stand-in: a fixed fp32 matmul (or nothing, for the raw figure)."""

    def __init__(self, n: int):
        g = torch.Generator().manual_seed(0)
        self.a, self.b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
        self.out = torch.empty(n, n)

    def __call__(self) -> None:
        torch.mm(self.a, self.b, out=self.out)


def consume(open_blocks, step: Step | None) -> dict:
    """One epoch of micro-batches in the run's global order; timestamps after each."""
    from components.train.data import BlockSampler

    t0 = time.perf_counter()
    blocks = open_blocks()
    sampler = BlockSampler(blocks, MICRO, 1, 1, 0, SEED)
    n_batches = len(blocks) // sampler.samples_per_micro_batch
    cpu, checksum, stamps = torch.device("cpu"), 0, []
    for k in range(n_batches):
        batch = sampler.batch(k * sampler.samples_per_micro_batch, cpu)
        checksum += int(batch.sum())
        if step is not None:
            step()
        stamps.append(time.perf_counter())
    result = {
        "steady": (n_batches - 1) * MICRO / (stamps[-1] - stamps[0]),
        "cold": n_batches * MICRO / (stamps[-1] - t0),
        "first_batch_s": stamps[0] - t0,
        "checksum": checksum,
        "blocks": n_batches * MICRO,
    }
    if hasattr(blocks, "fetches"):
        files = list(blocks.cache_dir.glob("*.arrow"))
        result.update(fetches=blocks.fetches, cached=len(files), cache_bytes=blocks.disk_bytes())
    blocks.close()
    return result


def build(tmp: Path, endpoint: str):
    """The dataset in the bucket (the real stage) and its train shard files on local disk."""
    from components.config import StoreBackend, compose, defaults
    from components.store import Ref, open_store
    from components.tokenize.stage import run_tokenize

    os.environ.update(
        MINIO_ENDPOINT=endpoint,
        MINIO_ACCESS_KEY="bench-access",
        MINIO_SECRET_KEY="bench-secret",
        MINIO_SECURE="false",
    )
    paths = write_corpus(tmp)
    overrides = [
        f"data.paths=[{','.join(map(str, paths))}]",
        "data.name=bench-stream",
        f"data.seq_len={SEQ_LEN}",
        f"model.max_seq_len={SEQ_LEN}",
        f"data.shards={SHARDS}",
        f"data.num_proc={os.cpu_count() or 1}",
        f"data.cache_gb={CACHE_GB}",
        "tokenizer.sample_mb=1",
    ]
    cfg = OmegaConf.to_object(compose(overrides))

    def store_cfg(cache: str):
        return defaults("store", backend=StoreBackend.minio, bucket="bench-stream", root="", cache_dir=str(tmp / cache))

    t0 = time.perf_counter()
    manifest = run_tokenize(cfg.data, cfg.tokenizer, cfg.model, open_store(store_cfg("tokenize-cache"))).manifest
    print(f"dataset {manifest.ref} made in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    store = open_store(store_cfg("fetch-cache"))
    local = []
    for i, row in enumerate(manifest.metadata["shards"]):
        local.append(tmp / "local" / f"{i:03d}.arrow")
        store.fetch_file(store.manifest(Ref.parse(row["ref"])), "train.arrow", local[-1])
    return manifest, store_cfg, local


def measure(manifest, store_cfg, local_paths: list[Path]) -> tuple[dict[str, list[dict]], float]:
    """RUNS interleaved rounds of the four configurations; (runs per configuration, step ms)."""
    from components.store import open_store
    from components.stream import open_split

    block_len = manifest.metadata["stats"]["block_len"]
    step = Step(MATMUL)
    for _ in range(5):
        step()
    t = time.perf_counter()
    for _ in range(50):
        step()
    step_ms = (time.perf_counter() - t) / 50 * 1e3
    runs: dict[str, list[dict]] = {"local": [], "stream": [], "local_raw": [], "stream_raw": []}
    for r in range(RUNS):
        for compute, suffix in ((step, ""), (None, "_raw")):
            runs["local" + suffix].append(consume(partial(LocalShards, local_paths, block_len), compute))
            store = open_store(store_cfg(f"node-{r}{suffix}"))  # an empty node cache each run
            runs["stream" + suffix].append(consume(partial(open_split, store, manifest, "train", CACHE_GB), compute))
    for name, rs in runs.items():
        assert len({x["checksum"] for x in rs + runs["local"]}) == 1, f"{name} read other tokens than local"
    return runs, step_ms


def main() -> None:
    torch.set_num_threads(1)
    server, endpoint = start_s3()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            os.environ["HF_DATASETS_CACHE"] = str(Path(tmp) / "hf")  # datasets' copies of the sources: not ~/.cache
            manifest, store_cfg, local_paths = build(Path(tmp), endpoint)
            runs, step_ms = measure(manifest, store_cfg, local_paths)
    finally:
        server.terminate()
        server.wait(timeout=30)
    stats = manifest.metadata["stats"]
    med = {name: {k: statistics.median(x[k] for x in rs) for k in ("steady", "cold")} for name, rs in runs.items()}
    last, shards, split_bytes = runs["stream"][-1], len(local_paths), stats["splits"]["train"]["bytes"]
    for name, rs in runs.items():
        print(
            f"{name:>10}: steady {[round(x['steady']) for x in rs]} blocks/s, cold {[round(x['cold']) for x in rs]}, "
            f"first batch {[round(x['first_batch_s'] * 1e3, 1) for x in rs]} ms"
        )
    print(
        f"{shards} shards, train split {split_bytes / 1e6:.1f} MB, cache budget {CACHE_GB * 2**30 / 1e6:.1f} MB: "
        f"{last['fetches']} fetches, {last['cached']} shard files ({last['cache_bytes'] / 1e6:.1f} MB) left, "
        f"step stand-in {step_ms:.2f} ms, micro-batch {MICRO} x {stats['block_len']} tokens"
    )
    report(
        "stream_reader",
        med["stream"]["steady"],
        med["local"]["steady"],
        "blocks/s",
        raw_ratio=med["stream_raw"]["steady"] / med["local_raw"]["steady"],
        raw_stream=med["stream_raw"]["steady"],
        raw_local=med["local_raw"]["steady"],
        cold_ratio=med["stream"]["cold"] / med["local"]["cold"],
        step_ms=round(step_ms, 2),
        micro_batch=MICRO,
        block_len=stats["block_len"],
        shards=shards,
        train_mb=round(split_bytes / 1e6, 1),
        cache_mb=round(CACHE_GB * 2**30 / 1e6, 1),
        fetches=last["fetches"],
        evicted=last["fetches"] - last["cached"],
        runs=RUNS,
    )


if __name__ == "__main__":
    main()
