"""Per-node measurements: GEMM TFLOP/s per dtype, memory bandwidth, all-reduce, host facts;
the names they are recorded under in a node's record (nodes.json, the KFP metrics) and the
typed view of a record, `NodeMeasurement`, which everything that reads a record goes through."""

from __future__ import annotations

import os
import platform
import resource
import shutil
import socket
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from components.config import ModelConfig, TrainConfig
from components.model_math import host_memory_bytes
from components.precision import Recipe

GEMM = "gemm_tflops_"  # + the precision recipe's name
BUSBW = "allreduce_busbw_gbps"  # + _<MB>mb per message size


def gemm_key(dtype: str) -> str:
    return GEMM + dtype


def busbw_key(mb: float) -> str:
    return f"{BUSBW}_{mb:g}mb"


@dataclass(frozen=True)
class NodeMeasurement:
    """One device's benchmark figures, typed, from its record."""

    rank: int
    host: str
    gemm_tflops: dict[str, float]  # by precision recipe
    membw_gbps: float | None
    busbw_gbps: dict[float, float]  # by all-reduce message size, MB
    device_memory_gb: float | None
    host_step_s: float | None = None  # the run's step at a negligible size (host_step_s): dispatch alone

    @classmethod
    def of(cls, record: dict) -> NodeMeasurement:
        sizes = {mb: record[busbw_key(mb)] for mb in record.get("allreduce_sizes_mb", [])}
        gemm = {k[len(GEMM) :]: float(v) for k, v in record.items() if k.startswith(GEMM)}
        memory = record.get("device_memory_gb")
        host = record.get(HOST_STEP)
        return cls(record["rank"], record["host"], gemm, record.get("membw_gbps"), sizes, memory, host)

    @property
    def largest_busbw_gbps(self) -> float | None:
        """The largest message's bus bandwidth: the bandwidth-bound one (what floors and the plan use)."""
        return self.busbw_gbps[max(self.busbw_gbps)] if self.busbw_gbps else None


def _timed(fn, iters: int, device: torch.device) -> float:
    fn()  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) / iters


GEMM_BATCH_S = 0.02  # each timed batch of GEMMs lasts at least this long


def _best(fn, iters: int, device: torch.device) -> float:
    """Seconds per call of the fastest of `iters` batches, each of as many calls as last
    GEMM_BATCH_S: a small GEMM (the tiny CPU run's: 128 cubed, ~0.5 ms) timed 3 times in a row
    read a busy machine's hiccup as the device's speed (it planned a step at 2.9x the run's).
    Not for collectives: the number of calls is each rank's own."""
    fn()  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    calls = max(1, int(GEMM_BATCH_S / max(time.perf_counter() - t0, 1e-9)))
    best = float("inf")
    for _ in range(iters):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def gemm_tflops(precision: Recipe, size: int, iters: int, device: torch.device) -> float:
    """Achieved TFLOP/s of the precision's size x size x size matmul (2·n³ FLOPs): the fastest of
    `iters` batches (`_best`)."""
    return 2 * size**3 / _best(precision.gemm(size, device), iters, device) / 1e12


HOST_STEP = "host_step_s"  # a node's record: seconds of one step of the run's op graph at a negligible size
PROXY_HEAD_DIM, PROXY_FFN, PROXY_VOCAB, PROXY_TOKENS = 16, 32, 256, 16  # every dim fp8-eligible (multiples of 16)


def proxy_model(model: ModelConfig, train: TrainConfig) -> ModelConfig:
    """The run's model as a host-overhead proxy: its family, one pipeline stage's blocks, its
    query-head groups (two kv heads' queries: the same grouped-query ops run), experts and
    routing, every width shrunk to PROXY_HEAD_DIM and PROXY_FFN: the same modules and ops as the
    run's rank dispatches, on tensors small enough that compute is nothing beside dispatch."""
    kv = min(model.num_kv_heads, 2)  # one kv head would make its transposes views, not copies
    heads = model.num_heads // model.num_kv_heads * kv
    return replace(
        model,
        vocab_size=PROXY_VOCAB,
        hidden_size=heads * PROXY_HEAD_DIM,
        num_layers=-(-model.num_layers // train.pp),
        num_heads=heads,
        num_kv_heads=kv,
        ffn_hidden_size=PROXY_FFN,
        max_seq_len=PROXY_TOKENS,
    )


def host_step(model: ModelConfig, train: TrainConfig, device: torch.device):
    """One training step of `proxy_model`, as a callable: its micro-batches' forward and
    backward, clipping and the optimizer step, under the run's precision recipe, activation
    checkpointing, chunked loss and fused AdamW, on PROXY_TOKENS tokens per micro-batch."""
    from components.models import build_model, token_loss
    from components.optimizer import build_optimizer
    from components.parallel.checkpointing import apply_activation_checkpointing
    from components.parallel.dims import pipeline_microbatches
    from components.precision import recipe

    net = build_model(proxy_model(model, train), PROXY_VOCAB, train.seed).to(device)
    precision = recipe(train.precision)
    precision.apply(net, train, device)
    apply_activation_checkpointing(net, train.activation_checkpointing, train.ac_every_n_blocks)
    optimizer = build_optimizer(net, train)
    micro = pipeline_microbatches(train)[0]
    batch = torch.randint(0, PROXY_VOCAB, (1, PROXY_TOKENS + 1), device=device)

    def step() -> None:
        for _ in range(micro):
            with precision.autocast(device, False):
                logits = net(input_ids=batch[:, :-1]).logits
            token_loss(logits, batch[:, 1:], train.loss_chunk_tokens).backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), train.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def host_step_s(model: ModelConfig, train: TrainConfig, device: torch.device, iters: int) -> float:
    """Seconds of one `host_step`, the median of `iters` after two of warm-up: what a rank's
    host spends dispatching a step of the run whatever the model's width. On a CPU it adds to
    the GEMMs' time, on a GPU it hides under them unless it is the longer. Eager: a compiled
    step's host time is its own (not measured)."""
    step = host_step(model, train, device)
    times = []
    for i in range(iters + 2):
        t0 = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def memory_bandwidth_gbps(megabytes: int, iters: int, device: torch.device) -> float:
    """Device memory bandwidth from a large copy: read + write = 2 x bytes."""
    n = megabytes * (1 << 20) // 4
    src = torch.ones(n, device=device)
    dst = torch.empty_like(src)
    seconds = _timed(lambda: dst.copy_(src), iters, device)
    return 2 * src.numel() * 4 / seconds / 1e9


def allreduce_busbw(sizes_mb: list[float], device: torch.device, iters: int = 5) -> dict:
    """All-reduce bus bandwidth per message size (nccl-tests: busbw = algbw x 2(n-1)/n) and
    the latency of an 8-byte all-reduce, as a node's record holds them."""
    world = dist.get_world_size()
    out: dict = {"allreduce_sizes_mb": [float(mb) for mb in sizes_mb]}
    for mb in sizes_mb:
        t = torch.ones(max(1, int(mb * (1 << 20) / 4)), device=device)
        seconds = _timed(lambda t=t: dist.all_reduce(t), iters, device)
        algbw = t.numel() * 4 / seconds / 1e9
        out[busbw_key(mb)] = algbw * 2 * (world - 1) / world if world > 1 else algbw
    small = torch.ones(2, device=device)
    out["allreduce_latency_us"] = _timed(lambda: dist.all_reduce(small), 20, device) * 1e6
    return out


def accelerator(device: torch.device) -> str:
    """The kind of device, as the verdict groups devices: the GPU's name, or the CPU's machine."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu:{platform.machine()}:{_cpu_model()}"  # a CPU generation's kernels round their own way


def _cpu_model() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "unknown")
    except OSError:
        return platform.processor() or "unknown"


def host_facts(device: torch.device, checkpoint_dir: Path) -> dict:
    shm = shutil.disk_usage("/dev/shm").total if os.path.isdir("/dev/shm") else 0
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    facts = {
        "host": os.environ.get("NODE_NAME") or socket.gethostname(),
        "shm_gb": shm / 1e9,
        "memlock_unlimited": soft == resource.RLIM_INFINITY,
        "free_disk_gb": shutil.disk_usage(checkpoint_dir).free / 1e9,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "accelerator": accelerator(device),
        "cuda": torch.version.cuda or "none",
        "driver": _driver_version() if device.type == "cuda" else "none",
    }
    if device.type == "cuda":
        facts["device_memory_gb"] = torch.cuda.get_device_properties(device).total_memory / 1e9
    else:
        facts["device_memory_gb"] = host_memory_bytes() / 1e9
    return facts


def _driver_version() -> str:
    try:
        return Path("/proc/driver/nvidia/version").read_text().split("Kernel Module")[1].split()[0]
    except (OSError, IndexError):
        return "unknown"
