"""gpu_parallel: liftoff's train step sharded over every GPU of one node, one case per torchrun
launch (its peak memory its own), for `benchmarks/gpu.py` when the node has 2 or more GPUs:

- `fsdp/bf16`: FSDP2, bf16 compute (MixedPrecisionPolicy), the reference;
- `fsdp/fp8`: FSDP2 with torchao's float8 tensorwise recipe, whose weights are all-gathered in
  fp8 (`enable_fsdp_float8_all_gather`, scales precomputed after each optimizer step);
- `hsdp/bf16`: FSDP2 on a (2, world / 2) mesh: shard groups of half the GPUs, two replicas
  (4 or more GPUs);
- `tp/bf16`, `tp/fp8`: tensor parallelism of degree 2 (torchao's float8 TP styles for fp8),
  FSDP2 over the other world / 2 ranks (none on 2 GPUs); `tp_fsdp/fp8`: the same with TP=2 and
  FSDP over the rest, fp8 all-gathered (4 or more GPUs).

Each rank builds the model as the worker does (precision conversion, then `parallel.parallelize`:
TP, activation checkpointing, compile per block, FSDP), trains on random tokens (tensor-parallel
peers on the same ones) and times STEPS steps after
WARMUP; rank 0 prints one JSON line: tokens/s over all ranks, MFU against the bf16 peak x world,
peak memory, and the live model's wrapper counts (fp8 all-gather parameters read off the model).
`python -m benchmarks.gpu_parallel --smoke` runs the same under torchrun on 2 CPU processes
(gloo, the tiny model) to check the script itself: every case in one launch, one after another in
one process group (a launch costs more than the tiny cases).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist

CASES = (("fsdp", "bf16"), ("fsdp", "fp8"), ("hsdp", "bf16"), ("tp", "bf16"), ("tp", "fp8"), ("tp_fsdp", "fp8"))
WARMUP, STEPS = 3, 10


def run(layout: str, precision: str, model_name: str, ac_every: int, micro: int, seq_len: int) -> dict | None:

    from benchmarks.gpu import preset, train_config
    from components.config import Parallelism, Precision
    from components.devices import peak_tflops
    from components.model_math import flops_per_token, mfu
    from components.models import build_model, count_params, token_loss
    from components.optimizer import build_optimizer
    from components.parallel import ParallelDims
    from components.parallel.apply import parallelize
    from components.parallel.tensor import loss_scope
    from components.precision import recipe
    from components.train.handback import wrapped_modules
    from components.train.optim import clip_and_step

    cuda = torch.cuda.is_available()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    model_cfg = preset(model_name)
    model_cfg.vocab_size = model_cfg.vocab_size or 1024
    on_cpu = "fp32" if precision == "bf16" else precision  # the CPU smoke: fp32 for the bf16 cases
    train = train_config(precision if cuda else on_cpu, "tensorwise", ac_every, micro)
    train.parallelism, train.compile = Parallelism.fsdp, cuda
    train.dp_replicate = 2 if layout == "hsdp" else 1
    train.tp = 2 if layout.startswith("tp") else 1
    dims = ParallelDims.of(train, world)
    sharded = dims.dp > 1  # FSDP applied (a TP=2 case on 2 GPUs has no data parallelism)
    with torch.device(device):
        model = build_model(model_cfg, model_cfg.vocab_size, seed=0)
    flops = flops_per_token(model_cfg, count_params(model, exclude_embeddings=True), seq_len)
    r = recipe(Precision(train.precision))
    r.apply(model, train, device)
    model = parallelize(model, train, dims, device, r)
    r.after_optimizer_step(model, train, sharded)
    optimizer = build_optimizer(model, train)
    g = torch.Generator(device=device).manual_seed(dims.dp_rank(rank))
    batch = torch.randint(0, model_cfg.vocab_size, (micro, seq_len + 1), device=device, generator=g)

    def step() -> None:
        with loss_scope(model):  # the trainer's: under TP with sequence parallel, the loss-parallel one
            with r.autocast(device, fsdp=sharded):
                logits = model(input_ids=batch[:, :-1]).logits
            token_loss(logits, batch[:, 1:]).backward()
        clip_and_step(model, optimizer, 1.0, None)
        r.after_optimizer_step(model, train, sharded)

    for _ in range(WARMUP):
        step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(STEPS):
        step()
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    seconds = (time.perf_counter() - t0) / STEPS
    tokens_per_s = micro * seq_len * dims.dp / seconds  # tensor-parallel peers share their tokens
    peak = peak_tflops(torch.cuda.get_device_name(device)) if cuda else None
    row = {
        "kind": "parallel",
        "layout": layout,
        "precision": train.precision.value,
        "world": world,
        "dp_replicate": train.dp_replicate,
        "tp": train.tp,
        "model": model_name,
        "micro_batch": micro,
        "seq_len": seq_len,
        "step_s": seconds,
        "tokens_per_s": tokens_per_s,
        "mfu": mfu(tokens_per_s, flops, peak, world),
        "wrapped": wrapped_modules(model),
    }
    if cuda:
        row["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
    return row if rank == 0 else None


def launch(nprocs: int, todo: list[tuple[str, str]], args: list[str]) -> list[dict]:
    """Cases under one torchrun on this node; rank 0's row of each (a failed row for each without one)."""
    spec = ",".join(f"{layout}/{precision}" for layout, precision in todo)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nprocs}",
           "-m", "benchmarks.gpu_parallel", "--case", spec, *args]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env)
    rows = {r.pop("case"): r for r in map(json.loads, (ln for ln in proc.stdout.splitlines() if ln.startswith("{")))}
    if proc.returncode:  # a launch that failed fails every case in it, rows printed or not
        rows = {}
    failed = proc.returncode or "no row"
    return [rows.get(f"{layout}/{precision}") or {"kind": "parallel", "layout": layout, "precision": precision,
                                                  "failed": failed} for layout, precision in todo]  # fmt: skip


def cases(nprocs: int) -> list[tuple[str, str]]:
    four = nprocs >= 4 and nprocs % 2 == 0  # two replicas or TP=2 beside FSDP over 2+ ranks
    return [(layout, p) for layout, p in CASES if layout not in ("hsdp", "tp_fsdp") or four]


def run_cases(spec: str, model_name: str, ac_every: str, micro: str, seq_len: str) -> None:
    """This rank's share of each case in `spec` ("layout/precision,..."), in one process group."""
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        for case in spec.split(","):
            layout, precision = case.split("/")
            row = run(layout, precision, model_name, int(ac_every), int(micro), int(seq_len))
            if row is not None:
                row["case"] = case
                print(json.dumps(row), flush=True)
    finally:
        dist.destroy_process_group()


def main(argv: list[str]) -> int:
    if "--case" in argv:
        i = argv.index("--case")
        run_cases(*argv[i + 1 : i + 6])
        return 0
    smoke = "--smoke" in argv
    nprocs = 2 if smoke else torch.cuda.device_count()
    args = ["tiny", "1", "2", "64"] if smoke else argv[:4]
    todo = cases(nprocs)
    rows = launch(nprocs, todo, args) if smoke else [row for case in todo for row in launch(nprocs, [case], args)]
    for row in rows:
        print(json.dumps(row), flush=True)
    return 1 if any("failed" in row for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
