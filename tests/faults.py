"""Test-only fault injection into real worker processes.

`with injected(nan_steps=[5]): ...` sets LIFTOFF_WORKER_PLUGIN=tests.faults and the faults
in the environment the launched workers inherit; each worker then imports this module and
calls `install` (train) or `install_preflight` (preflight). Nothing here ships in the config
or runs in the production loop.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import time
from pathlib import Path

import torch

from components.worker_side import PLUGIN_ARGS_ENV, PLUGIN_ENV

FAULTS_ENV = PLUGIN_ARGS_ENV
RAISED_VERSION = "fault-injected-7c1e"  # in the message of raise_rank's NotFound
log = logging.getLogger("liftoff.faults")


def fault_env(**faults) -> dict[str, str]:
    """nan_steps=[...]: steps whose forward turns non-finite (from the embeddings on);
    nan_weight + nan_weight_steps: that parameter (its name in the plain model) holds a NaN
    during those steps only, so the first non-finite output is inside a block, compiled or
    not; kill_rank/kill_step: that rank
    SIGKILLs itself (first attempt only); raise_rank/raise_step: that rank raises the store's
    `NotFound` (every attempt), so its peers then fail on the lost connection;
    slow_rank/slow_seconds: a slow device; hang_rank/
    hang_step: a rank that stops making progress; stall_rank/stall_step: a rank that stops
    inside a collective, before the backend, while its peers wait in it; throttle_node: a
    preflight node whose GEMMs run slow; perturb_node/perturb_op: a preflight node whose
    numerics battery op is one ulp off in one element; flip_rank/flip_step/flip_param: that rank's
    parameter gets one flipped mantissa bit in its first element after that step (once per
    process: a transient fault); corrupt_samples [start, end): those global samples' blocks read
    as one repeated token (a corrupted data window); weights_dir: every rank writes the sha256 of
    its parameters' bytes there as it exits; perturb_rank/perturb_step/perturb_param/perturb_value:
    that rank's weight-gradient matmul is off by the value in one element, once (a transient
    compute fault); host_reads_dir: not a fault, a probe: every rank counts its reads of a
    device value back to the host, per step, into <dir>/rank<r>.json (`count_host_reads`)."""
    return {PLUGIN_ENV: "tests.faults", FAULTS_ENV: json.dumps(faults)}


@contextlib.contextmanager
def injected(**faults):
    saved = {k: os.environ.get(k) for k in (PLUGIN_ENV, FAULTS_ENV)}
    os.environ.update(fault_env(**faults))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _faults() -> dict:
    return json.loads(os.environ.get(FAULTS_ENV, "{}"))


def install(job, state) -> None:
    f = _faults()
    model = getattr(job.model, "module", job.model)  # under DDP, the wrapped model
    if f.get("nan_steps"):
        nan_steps = set(f["nan_steps"])

        def poison(module, args, output):
            return output * float("nan") if state.step in nan_steps else output

        model.get_input_embeddings().register_forward_hook(poison)
    if job.rank == f.get("slow_rank", -1):
        model.register_forward_pre_hook(lambda module, args: time.sleep(f["slow_seconds"]))

    if f.get("nan_weight"):
        from components.train.nonfinite import clean_name

        # under pipeline parallelism only the rank whose stage holds it
        weight = next((p for n, p in job.model.named_parameters() if clean_name(n) == f["nan_weight"]), None)
        weight = getattr(weight, "_local_tensor", weight)  # a DTensor's (TP, FSDP) own shard on this rank
        saved: list = []

        def nan_weight(step: int) -> None:
            if weight is None:
                return
            with torch.no_grad():
                if step in f["nan_weight_steps"] and not saved:
                    saved.append(weight.detach().clone())
                    weight.view(-1)[0] = float("nan")
                elif step not in f["nan_weight_steps"] and saved:
                    weight.copy_(saved.pop())

        job.on_step.append(nan_weight)

    if job.rank == f.get("stall_rank", -1):  # stalls inside a collective, before the backend

        def stall(c) -> None:
            if c.step == f["stall_step"]:
                log.warning("fault injection: rank %d stalls in %s #%d at step %d", job.rank, c.op, c.seq, c.step)
                while True:
                    time.sleep(3600)

        job.collectives.before_backend.append(stall)

    if job.rank == f.get("flip_rank", -1):
        flip_bit(job, f["flip_step"], f["flip_param"])
    if job.rank == f.get("perturb_rank", -1):
        perturb_gradient(job, state, f["perturb_step"], f["perturb_param"], f["perturb_value"])
    if f.get("corrupt_samples"):
        corrupt(job, *f["corrupt_samples"])
    if f.get("weights_dir"):
        write_weights_hash(job, Path(f["weights_dir"]))

    if f.get("record_dir"):  # every block this rank trains on, by its global sample number
        record_batches(job, Path(f["record_dir"]))
    if f.get("host_reads_dir"):
        count_host_reads(job, Path(f["host_reads_dir"]))

    def tick(step: int) -> None:
        if job.rank == f.get("hang_rank", -1) and step == f.get("hang_step"):
            log.warning("fault injection: rank %d hangs at step %d", job.rank, step)
            while True:
                time.sleep(3600)
        first_attempt = os.environ.get("LIFTOFF_ATTEMPT", "0") == "0"
        if job.rank == f.get("kill_rank", -1) and step == f.get("kill_step") and first_attempt:
            log.warning("fault injection: rank %d SIGKILLs itself at step %d", job.rank, step)
            os.kill(os.getpid(), signal.SIGKILL)
        if job.rank == f.get("raise_rank", -1) and step == f.get("raise_step"):
            from components.store import NotFound

            log.warning("fault injection: rank %d raises NotFound at step %d", job.rank, step)
            raise NotFound(f"no version {RAISED_VERSION} of checkpoint/tiny in the store")

    job.on_step.append(tick)


def count_host_reads(job, out: Path) -> None:
    """Every read of a tensor's value by the host in this rank's training thread, counted per
    step: `aten._local_scalar_dense` (what `.item()`, `float()`, `int()` and `bool()` of a tensor
    dispatch: on a GPU each waits for the launch queue to drain) seen by a dispatch mode entered
    here for the rest of the process, and `Tensor.tolist` (which reads the storage without
    dispatching). A step's reads are those from its `on_step` to the next's (its settling and
    checks included); the counts so far are written at each step's start."""
    from torch.utils._python_dispatch import TorchDispatchMode

    counts: dict[int, int] = {}
    current = [0]

    def read() -> None:
        counts[current[0]] = counts.get(current[0], 0) + 1

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                read()
            return func(*args, **(kwargs or {}))

    tolist = torch.Tensor.tolist

    def counted_tolist(self):
        read()
        return tolist(self)

    torch.Tensor.tolist = counted_tolist
    Reads().__enter__()  # for the rest of the process, in the thread that trains
    out.mkdir(parents=True, exist_ok=True)

    def mark(step: int) -> None:
        current[0] = step
        (out / f"rank{job.rank}.json").write_text(json.dumps(counts))

    job.on_step.insert(0, mark)


def flip_bit(job, at_step: int, name: str, bit: int = 12) -> None:
    from components.train.nonfinite import clean_name

    weight = next(p for n, p in job.model.named_parameters() if clean_name(n) == name)
    done: list = []

    def flip(step: int) -> None:
        if step == at_step + 1 and not done:  # as the next step starts: after `at_step`
            done.append(step)
            with torch.no_grad():
                bits = weight.detach().view(-1)[:1].view(torch.int32)
                bits ^= 1 << bit
            log.warning("fault injection: rank %d flips bit %d of %s[0] after step %d", job.rank, bit, name, at_step)

    job.on_step.append(flip)


def perturb_gradient(job, state, at_step: int, name: str, value: float) -> None:
    """The weight-gradient GEMM of that parameter is off by `value` in one element at `at_step`
    (once per process: a transient compute fault), before DDP reduces it."""
    from components.train.nonfinite import clean_name

    weight = next(p for n, p in job.model.named_parameters() if clean_name(n) == name)
    done: list = []

    def perturb(grad):
        if state.step == at_step and not done:
            done.append(at_step)
            grad = grad.clone()
            grad.view(-1)[0] += value
            log.warning("fault injection: rank %d's %s gradient off by %g at step %d", job.rank, name, value, at_step)
        return grad

    weight.register_hook(perturb)


def corrupt(job, start: int, end: int) -> None:
    """Blocks of global samples in [start, end) read as token 3 repeated."""
    sampler, batch = job.sampler, job.sampler.batch

    def corrupted(sample: int, device):
        rows = batch(sample, device)
        first = sample + sampler.rank * sampler.micro
        for i in range(len(rows)):
            if start <= first + i < end:
                rows[i] = 3
        return rows

    sampler.batch = corrupted


def write_weights_hash(job, out: Path) -> None:
    import atexit
    import hashlib

    def write() -> None:
        h = hashlib.sha256()
        for p in job.model.parameters():
            h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rank{job.rank}.txt").write_text(h.hexdigest())

    atexit.register(write)


def record_batches(job, out: Path) -> None:
    """Wrap the sampler: append {global sample: [blake2b of the block's bytes, its shard]} per micro-batch to
    out/rank<r>-<pid>.jsonl, from the rows the reader returned (their content, not indices)."""
    import hashlib

    sampler, batch = job.sampler, job.sampler.batch
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"rank{job.rank}-{os.getpid()}.jsonl"

    def recorded(sample: int, device):
        rows = batch(sample, device)
        first = sample + sampler.rank * sampler.micro
        seen = {
            first + i: [hashlib.blake2b(r.cpu().numpy().tobytes(), digest_size=8).hexdigest(), s]
            for i, (r, (s, _)) in enumerate(zip(rows, sampler.indices(sample), strict=True))
        }
        with open(path, "a") as f:
            f.write(json.dumps(seen) + "\n")
        return rows

    sampler.batch = recorded


def read_batches(out: Path) -> dict[int, list[tuple[str, int]]]:
    """global sample -> (block hash, shard) recorded for it, one per time it was trained on."""
    seen: dict[int, list[tuple[str, int]]] = {}
    for p in sorted(out.glob("rank*.jsonl")):
        for line in p.read_text().splitlines():
            for k, (h, s) in json.loads(line).items():
                seen.setdefault(int(k), []).append((h, s))
    return seen


def install_preflight(rank: int) -> None:
    """The throttled node's GEMMs each take 0.5 s longer, as a degraded device would; the
    perturbed node's `perturb_op` (numerics battery) returns one element one ulp off."""
    from components.precision import RECIPES
    from components.preflight import numerics

    if rank == _faults().get("perturb_node", -1):
        op = _faults().get("perturb_op", "sdpa")

        def perturbed(args, run=numerics.RUN[op]):
            y = run(args).clone()
            y.view(-1)[0] = torch.nextafter(y.view(-1)[0], torch.tensor(float("inf"), dtype=y.dtype))
            return y

        numerics.RUN[op] = perturbed
    if rank != _faults().get("throttle_node", -1):
        return
    for precision in RECIPES.values():

        def slow_gemm(size, device, gemm=precision.gemm):
            op = gemm(size, device)

            def throttled():
                op()
                time.sleep(0.5)

            return throttled

        precision.gemm = slow_gemm
