"""The preflight process on every node (one replica per node, launched like training).

Each rank measures its node; rank 0 gathers every node's numbers and publishes them to
the store, where the stage (which may run in another pod) reads them back.
"""

from __future__ import annotations

import importlib
import json
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from components.config import PreflightConfig
from components.distributed import init_distributed
from components.precision import RECIPES
from components.preflight import bench, numerics
from components.preflight.spec import PreflightSpec
from components.store import Ref, open_store
from components.stream import shard_table
from components.worker_side import PLUGIN_ENV, exit_now, worker_spec

READ_CHUNK = 1 << 20  # the probe reads as a shard fetch streams: in ranged chunks


def storage_probe(store, dataset: str | None, probe_mb: int, rank: int) -> dict:
    """Read throughput of `preflight.read_probe_mb` read in ranged chunks from the dataset's
    largest train shard (round again from its start when the shard is smaller), never the
    dataset itself, and a write/read/delete round trip."""
    out = {}
    if dataset:
        largest = max(shard_table(store.manifest(Ref.parse(dataset)), "train"), key=lambda s: s["bytes"])
        shard = store.manifest(largest["ref"])
        size, want, got = shard.files["train.arrow"]["size"], probe_mb << 20, 0
        t0 = time.perf_counter()
        while got < want:
            offset = got % size
            chunk = store.read_range(shard, "train.arrow", offset, min(READ_CHUNK, want - got, size - offset))
            if not chunk:
                raise RuntimeError(f"{shard.ref}: train.arrow read nothing at {offset} of {size} bytes")
            got += len(chunk)
        out["storage_read_mbps"] = got / (time.perf_counter() - t0) / 1e6
        out["storage_read_mb"] = got / 2**20
    payload = os.urandom(probe_mb * (1 << 20))
    key = f"preflight-probe/{os.uname().nodename}-{rank}-{os.getpid()}"
    t0 = time.perf_counter()
    store.backend.put_bytes(key, payload)
    ok = store.backend.get_bytes(key) == payload
    store.backend.delete(key)
    out["storage_probe_ok"] = ok
    out["storage_roundtrip_mbps"] = 2 * len(payload) / (time.perf_counter() - t0) / 1e6
    return out


def measure_device(cfg: PreflightConfig, spec: PreflightSpec, rank: int, device: torch.device, store) -> dict:
    """One process per device, as training runs: each measures its own GPU (or, locally, its
    share of the CPU); the node's first process also measures the store."""
    m: dict = bench.host_facts(device, Path(spec.checkpoint_dir))
    m.update(local_rank=int(os.environ.get("LOCAL_RANK", "0")), device=str(device))
    for precision in RECIPES.values():
        if precision.supported(device):
            m[bench.gemm_key(precision.name)] = bench.gemm_tflops(precision, cfg.gemm_size, cfg.gemm_iters, device)
    gpu = device.type == "cuda"
    m["membw_gbps"] = bench.memory_bandwidth_gbps(cfg.membw_mb_gpu if gpu else cfg.membw_mb, 5, device)
    compiled = spec.train is not None and (spec.train.compile if spec.train.compile is not None else gpu)
    if spec.model is not None and not compiled:
        m[bench.HOST_STEP] = bench.host_step_s(spec.model, spec.train, device, cfg.gemm_iters)
    if m["local_rank"] == 0:
        m.update(storage_probe(store, spec.dataset, cfg.read_probe_mb, rank))
    return m


@record
def main(argv: list[str] | None = None) -> int:
    spec = worker_spec(argv, PreflightSpec)
    cfg = spec.preflight
    store = open_store(spec.store)
    rank, world, device = init_distributed(timeout_s=300)
    if plugin := os.environ.get(PLUGIN_ENV):  # how tests inject a degraded node into a real run
        importlib.import_module(plugin).install_preflight(rank)
    node = measure_device(cfg, spec, rank, device, store)
    sizes = cfg.allreduce_sizes_mb_gpu if device.type == "cuda" else cfg.allreduce_sizes_mb
    node.update(bench.allreduce_busbw(sizes, device))
    if cfg.numerics_s > 0:  # the same operators on the same inputs on every device: compared in the verdict
        node["numerics"] = numerics.measure(cfg.numerics_s, device, spec.dtype)
    node["rank"] = rank
    nodes = [None] * world
    dist.all_gather_object(nodes, node)
    if rank == 0:
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "nodes.json").write_text(json.dumps(nodes, indent=2))
            store.publish("preflight", spec.name, spec.run_id, Path(tmp))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_now(main())
