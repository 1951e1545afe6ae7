"""Preflight numerics: silent data corruption is a device that computes wrong numbers without
an error, so every device runs the same battery of training's operators (GEMM, SDPA, softmax,
RMSNorm, a reduction, an embedding gather) on the same seeded inputs in the stage's compute
dtype, and an all-reduce of values whose sum is exact. Each operator's results are hashed
(bits, in order) and held against an fp64 reference with a tolerance per dtype; the verdict
(verdict.py) compares the hashes bitwise across the devices of one type and against the
driver's own run where it is the same kind of device (a CPU rehearsal), so a device one ulp off
in one element is named with the operator. The battery runs for `preflight.numerics_s`
seconds: rank 0 times one round and every rank runs as many rounds."""

from __future__ import annotations

import contextlib
import hashlib
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 3e-3}  # max |y - ref| / max |ref| against fp64


def _rand(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g)


def _inputs(op: str, g: torch.Generator) -> tuple:
    """One round's inputs, made on the CPU in fp32 from its seed: the same bits on every device."""
    if op == "gemm":
        return _rand(g, 128, 256), _rand(g, 256, 128)
    if op == "sdpa":
        return _rand(g, 2, 4, 64, 32), _rand(g, 2, 4, 64, 32), _rand(g, 2, 4, 64, 32)
    if op in ("softmax", "rmsnorm"):
        return (_rand(g, 64, 512),)
    if op == "sum":
        return (_rand(g, 1 << 16),)
    if op == "embedding":
        return _rand(g, 1024, 128), torch.randint(0, 1024, (512,), generator=g)
    raise KeyError(op)


def _run(op: str, args: tuple) -> torch.Tensor:
    if op == "gemm":
        return args[0] @ args[1]
    if op == "sdpa":
        return F.scaled_dot_product_attention(*args, is_causal=True)
    if op == "softmax":
        return torch.softmax(args[0], dim=-1)
    if op == "rmsnorm":
        x = args[0]
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    if op == "sum":
        return args[0].sum(dim=0, keepdim=True)
    if op == "embedding":
        return F.embedding(args[1], args[0])
    raise KeyError(op)


OPS = ("gemm", "sdpa", "softmax", "rmsnorm", "sum", "embedding")
RUN = {op: (lambda args, op=op: _run(op, args)) for op in OPS}  # what a device runs (fault injection swaps one)


@contextlib.contextmanager
def _one_thread():
    """CPU kernels' results depend on how many threads split them: one, everywhere."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def battery(device: torch.device, dtype: str, rounds: int) -> dict:
    """{op: {digest, max_rel_err, tolerance}} over `rounds` rounds (round r seeds with r)."""
    kind = getattr(torch, dtype)
    out = {}
    with _one_thread(), torch.no_grad():
        for i, op in enumerate(OPS):
            digest, err = hashlib.sha256(), 0.0
            for r in range(rounds):
                args = _inputs(op, torch.Generator().manual_seed(1000 * r + i))
                here = tuple(a.to(device, kind) if a.is_floating_point() else a.to(device) for a in args)
                y = RUN[op](here).float().cpu()
                digest.update(y.numpy().tobytes())
                ref = _run(op, tuple(a.to(kind).double() if a.is_floating_point() else a for a in args))
                # a sum's rounding scales with the sum of its terms' sizes, not with its result's
                scale = args[0].abs().sum() if op == "sum" else ref.abs().max()
                err = max(err, float((y.double() - ref).abs().max() / scale.double().clamp_min(1e-30)))
            out[op] = {"digest": digest.hexdigest()[:16], "max_rel_err": err, "tolerance": TOLERANCE[dtype]}
    return out


def allreduce_exact(device: torch.device) -> bool:
    """Integers summed across every rank: a float32 all-reduce that must come back exact."""
    world, rank = dist.get_world_size(), dist.get_rank()
    base = torch.randint(0, 1000, (1 << 14,), generator=torch.Generator().manual_seed(7)).float()
    t = (base + rank).to(device)
    dist.all_reduce(t)
    return bool(torch.equal(t.cpu(), base * world + world * (world - 1) / 2))


def rounds_for(seconds: float, device: torch.device, dtype: str) -> int:
    """How many rounds fill `seconds` on rank 0 (every rank runs that many)."""
    t0 = time.perf_counter()
    battery(device, dtype, 1)
    each = max(time.perf_counter() - t0, 1e-3)
    found = [max(1, int(seconds / each))] if dist.get_rank() == 0 else [0]
    dist.broadcast_object_list(found, src=0)
    return found[0]


def measure(seconds: float, device: torch.device, dtype: str) -> dict:
    """A device's numerics record: the battery's results and the exact all-reduce."""
    rounds = rounds_for(seconds, device, dtype)
    ops = battery(device, dtype, rounds)
    return {"dtype": dtype, "rounds": rounds, "ops": ops, "allreduce_exact": allreduce_exact(device)}


def reference(nodes: list[dict], accelerator: str) -> dict | None:
    """The battery run here, by the driver, when the nodes are this kind of device (a CPU
    rehearsal) and ran one dtype and round count: what each of them must match bitwise."""
    runs = {(n["numerics"]["dtype"], n["numerics"]["rounds"]) for n in nodes if n.get("numerics")}
    if len(runs) != 1 or not any(n.get("accelerator") == accelerator for n in nodes):
        return None
    ((dtype, rounds),) = runs
    return {
        "accelerator": accelerator,
        "dtype": dtype,
        "rounds": rounds,
        "ops": battery(torch.device("cpu"), dtype, rounds),
    }


def problems(nodes: list[dict], ref: dict | None) -> dict[int, list[str]]:
    """Why each node's numerics are unsound, by its index: off the fp64 reference, an inexact
    all-reduce, or bits that differ from the reference run (else from the majority of the
    devices of its type)."""
    found: dict[int, list[str]] = {}
    for i, n in enumerate(nodes):
        num = n.get("numerics") or {}
        if num and not num["allreduce_exact"]:
            found.setdefault(i, []).append("numerics: an all-reduce of exact integers came back wrong")
        for op, r in num.get("ops", {}).items():
            if r["max_rel_err"] > r["tolerance"]:
                why = f"numerics: {op} is {r['max_rel_err']:.2g} off the fp64 reference (tolerance {r['tolerance']:g})"
                found.setdefault(i, []).append(why)
    groups: dict[tuple, list[int]] = {}
    for i, n in enumerate(nodes):
        if n.get("numerics"):
            groups.setdefault((n.get("accelerator"), n["numerics"]["dtype"], n["numerics"]["rounds"]), []).append(i)
    for (accelerator, dtype, rounds), members in groups.items():
        mine = (
            ref if ref and (ref["accelerator"], ref["dtype"], ref["rounds"]) == (accelerator, dtype, rounds) else None
        )
        for op in OPS:
            digests = {i: nodes[i]["numerics"]["ops"][op]["digest"] for i in members}
            for i in _odd(digests, mine["ops"][op]["digest"] if mine else None):
                against = "this device type's reference run" if mine else f"the other {accelerator} devices"
                found.setdefault(i, []).append(f"numerics: {op} in {dtype} differs bitwise from {against}")
    return found


def _odd(digests: dict[int, str], reference: str | None) -> list[int]:
    """The members whose bits differ: from the reference, else from a strict majority (none
    when they agree; all of them when no majority can tell)."""
    if reference is not None:
        return [i for i, d in digests.items() if d != reference]
    if len(set(digests.values())) <= 1:
        return []
    counts = {d: list(digests.values()).count(d) for d in set(digests.values())}
    common, count = max(counts.items(), key=lambda kv: kv[1])
    if count * 2 <= len(digests):
        return list(digests)
    return [i for i, d in digests.items() if d != common]
