"""Silent data corruption at run time: the replicas of a data-parallel group must hold
bit-identical weights (DDP ranks see the same reduced gradients and run the same optimizer),
so every `train.sdc_interval` steps, and before every checkpoint, each rank fingerprints its
parameters (per tensor, the int64 sum of the raw bits: one flipped bit changes it) and the
fingerprints are compared across ranks. A checkpoint is saved only after its step's check
passed, so every checkpoint is a verified one.

A mismatch is never committed: the run rewinds to the newest checkpoint. Who was wrong is
decided by a majority when one exists (three or more replicas: the healthy ones agree bit for
bit, even though the culprit's gradients reached them through the all-reduce). With two (a
tie), each rank keeps the values of the elements where the replicas disagree, the run replays
from the checkpoint to the same step (a transient fault does not recur), and the replay is the
third opinion: the replica whose values lie far from the replayed ones was corrupted; the
other is off only by what the culprit's gradients did to it (a bit flip's error against the
all-reduced noise of a few steps). The culprit's node is quarantined (components/fleet.py), so
the next launch keeps off it; training goes on from the replay, every rank on the verified
state. A disagreement the replay cannot settle (the replay disagrees again, or no replica is
clearly nearer) fails the stage, the ranks named.

Under FSDP every rank holds another shard: there is no replica to compare, and no check runs.
On the steps a check runs, each DDP rank also measures its gradient norm before the reduction
(a comm hook); a rank GRAD_OUTLIER times its peers' median, or non-finite, is an outlier: its
gradients already reached every replica, so the run rewinds and replays the step. An outlier
that reproduces bit for bit is the data's (recorded, nothing blamed); one that does not is a
device's, and its rank is blamed as above. Only the check steps are measured: a sample.

The replay needs deterministic kernels to attribute a tie on a GPU (`torch.use_deterministic_
algorithms`); a majority needs none.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist

from components.train.guards import GuardHalt
from components.train.job import Job, TrainState
from components.train.nonfinite import clean_name
from components.train.rollback import quarantine_rank, roll_back

log = logging.getLogger("liftoff.train")
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class SDCError(GuardHalt):
    """Replicas disagree and the replay could not say which one is wrong."""


def fingerprint(model: torch.nn.Module) -> torch.Tensor:
    """Per parameter tensor, the sum of its elements' raw bits as integers (int64, on the device)."""
    sums = []
    for p in model.parameters():
        local = getattr(p, "_local_tensor", p).detach()
        bits = local.contiguous().view(_INT[local.element_size()])
        sums.append(bits.sum(dtype=torch.int64))
    return torch.stack(sums)


def due(step: int, train) -> bool:
    """Whether the check runs after this step: on the interval and before every checkpoint."""
    if train.sdc_interval <= 0:
        return False
    return step % train.sdc_interval == 0 or step % train.checkpoint_interval == 0 or step == train.steps


@dataclass
class Verdict:
    culprits: list[int]  # the ranks that were wrong
    how: str  # "majority" | "replay" | "tie" (not yet decided: replay)
    settled: bool = True  # False: the replay could not say which replica was wrong
    distances: list[float] | None = None  # a replay's: each rank's largest distance from the replayed values


def judge(now: list[tuple]) -> Verdict | None:
    """The ranks' fingerprints: None when they agree, else a majority's culprits or a tie."""
    if len(set(now)) == 1:
        return None
    top, count = Counter(now).most_common(1)[0]
    if count * 2 > len(now):
        return Verdict([r for r in range(len(now)) if now[r] != top], "majority")
    return Verdict([], "tie", settled=False)


SETTLE = 8.0  # the culprit's distance from the replay is at least this many times the nearest rank's


def settle(values: list[list[float]], replayed: list[float]) -> Verdict:
    """The tie's ranks' values at the disagreeing elements against the replay's: the ranks far
    from it (beyond SETTLE times the nearest) were corrupted."""
    far = [max((_distance(v, c) for v, c in zip(vals, replayed, strict=True)), default=0.0) for vals in values]
    near = min(far)
    culprits = [r for r, d in enumerate(far) if (d > 0 if near == 0 else d > SETTLE * near)]
    return Verdict(culprits, "replay", settled=0 < len(culprits) < len(values), distances=far)


def _distance(v: float, c: float) -> float:
    d = abs(v - c)
    return d if math.isfinite(d) else math.inf  # a NaN is as far as it gets


def differing(now: list[tuple], names: list[str]) -> list[str]:
    return [names[i] for i in range(len(names)) if len({fp[i] for fp in now}) > 1]


MAX_ELEMENTS = 4096  # disagreeing elements kept per tensor for the replay's comparison


def _params(job: Job) -> dict[str, torch.Tensor]:
    return {clean_name(n): p.detach() for n, p in job.model.named_parameters()}


def disagreeing_elements(job: Job, tensors: list[str], step: int) -> tuple[dict[str, list[int]], list[list[float]]]:
    """Every replica's copy of each disagreeing tensor (a rare event: a few tensors gathered):
    the flat positions where they differ, and each rank's values there."""
    params, positions, values = _params(job), {}, [[] for _ in range(job.world)]
    for name in tensors:
        mine = params[name].contiguous()
        copies = [torch.empty_like(mine) for _ in range(job.world)]
        with job.collectives.collective("all_gather", f"sdc {name}", step):
            dist.all_gather(copies, mine)
        bits = torch.stack([c.view(-1).view(_INT[c.element_size()]) for c in copies])
        where = (bits != bits[0]).any(0).nonzero().flatten()[:MAX_ELEMENTS]
        positions[name] = where.tolist()
        for r, c in enumerate(copies):
            values[r] += c.view(-1)[where].double().tolist()
    return positions, values


def replayed_values(job: Job, positions: dict[str, list[int]]) -> list[float]:
    params = _params(job)
    out: list[float] = []
    for name, where in positions.items():
        flat = params[name].view(-1)
        out += flat[torch.tensor(where, dtype=torch.long, device=flat.device)].double().tolist()
    return out


GRAD_OUTLIER = 10.0  # a rank's local gradient norm this many times its peers' median is an outlier


def grad_outliers(norms: list[float]) -> list[int]:
    """The ranks whose local gradient norm is non-finite, or GRAD_OUTLIER times above or below
    the others' median. With two ranks far apart both are suspects: the replay tells."""
    if len(norms) < 2 or any(n < 0 for n in norms):  # not measured everywhere
        return []
    finite = [n for n in norms if math.isfinite(n)]
    if not finite:
        return []
    if len(norms) == 2:  # no median to stand for the healthy: both far apart are suspects
        a, b = norms
        far = len(finite) == 1 or max(a, b) > GRAD_OUTLIER * min(a, b)
        return [0, 1] if far else []
    median = statistics.median(finite)
    far = [r for r, n in enumerate(norms) if n > GRAD_OUTLIER * median or n * GRAD_OUTLIER < median]
    return [r for r, n in enumerate(norms) if not math.isfinite(n) or r in far]


REPRODUCES = 1e-3  # a replayed norm within this relative distance of the first pass's is the same


def reproduced(before: float, after: float) -> bool:
    if not (math.isfinite(before) and math.isfinite(after)):
        return math.isfinite(before) == math.isfinite(after)  # NaN again is NaN reproduced
    return abs(after - before) <= REPRODUCES * max(abs(before), abs(after), 1e-30)


def safe(norms: list[float]) -> list[float | None]:
    """Norms as strict JSON takes them: a non-finite one is null."""
    return [n if math.isfinite(n) else None for n in norms]


def _gather(job: Job, step: int) -> tuple[list[tuple], list[float]]:
    """Every rank's fingerprints and local gradient norm (its float64 bits in the last slot)."""
    mine = fingerprint(job.model)
    local = job.grad_norms.take()
    if local > 0 and job.scaler is not None:  # the norm of the gradients, not of the scaled loss's
        local /= job.scaler.get_scale()
    norm = torch.tensor([local], dtype=torch.float64, device=mine.device).view(torch.int64)
    mine = torch.cat([mine, norm])
    gathered = [torch.zeros_like(mine) for _ in range(job.world)]
    with job.collectives.collective("all_gather", "sdc fingerprints", step):
        dist.all_gather(gathered, mine)
    return [tuple(t[:-1].tolist()) for t in gathered], [float(t[-1:].view(torch.float64)) for t in gathered]


def _replayed(job: Job, suspect: dict, now: Verdict | None, norms: list[float]) -> Verdict | None:
    """The verdict once the replay of a suspect step came back; None: every suspect's norm
    reproduced, so the outlier is the data's, not a device's."""
    if now is not None:  # the replay disagrees again
        return Verdict(now.culprits or list(range(job.world)), "replay", settled=False)
    if suspect["kind"] == "weights":
        return settle(suspect["values"], replayed_values(job, suspect["positions"]))
    changed = [r for r in suspect["ranks"] if not reproduced(suspect["norms"][r], norms[r])]
    return Verdict(changed, "replay") if changed else None


def _replay(job: Job, state: TrainState, kind: str, why: str, **suspect) -> bool:
    """Rewind to the newest checkpoint; the loop replays to this step, where the suspect is judged."""
    step = state.step
    target = roll_back(job, state, step - 1, why, rewind=True)
    state.sdc_suspect = {"step": step, "kind": kind, "replay_from": str(target.ref), **suspect}
    return False


def check(job: Job, state: TrainState, stepped: bool = True) -> bool:
    """Compare the replicas' weights after this step; True when they agree (the step may be
    committed), False when the run rewound (the loop goes on from the checkpoint's step)."""
    if job.fsdp or job.dims.tp > 1 or job.dims.pp > 1 or job.world == 1:  # no whole replicas to compare
        return True
    step, names = state.step, [clean_name(n) for n, _ in job.model.named_parameters()]
    now, norms = _gather(job, step)
    suspect = state.sdc_suspect  # a suspect step being replayed: kept across the checks before it
    verdict = judge(now)
    if suspect is not None and (suspect["step"] <= step or verdict is not None):
        state.sdc_suspect, pending, tensors = None, suspect, suspect.get("tensors", [])
        if verdict is not None:  # the replay disagrees again: name what differs now
            tensors = differing(now, names)
        verdict = _replayed(job, suspect, verdict, norms)
        if verdict is None:
            job.sdc_reproduced.add(step)
            job.monitor.event("grad_outlier_reproduced", step=step, norms=safe(norms), ranks=suspect["ranks"])
            return True
    elif verdict is None:
        if not stepped or suspect is not None or not (odd := grad_outliers(norms)):
            return True  # a dropped step, or a replay under way: nothing new to replay for
        if step in job.sdc_reproduced:  # replayed before in this launch: the data's
            return True
        why = f"local gradient norms {norms} at step {step}: rank(s) {odd} an outlier"
        try:
            _replay(job, state, "gradients", why, ranks=odd, norms=norms)
        except GuardHalt:  # no checkpoint yet to replay from: recorded, and training goes on
            job.monitor.event("grad_outlier", step=step, ranks=odd, norms=safe(norms), replay_from=None)
            return True
        replay_from = state.sdc_suspect["replay_from"]
        job.monitor.event("grad_outlier", step=step, ranks=odd, norms=safe(norms), replay_from=replay_from)
        return False
    else:
        pending, tensors = None, differing(now, names)
    repeat = [r for r in verdict.culprits if r in job.sdc_blamed]
    if repeat:  # blamed before in this launch: its fault recurs, so this launch must end
        verdict.settled = False
    if verdict.how == "tie":  # two replicas: replay from the checkpoint to this step to tell
        positions, values = disagreeing_elements(job, tensors, step)
        why = f"silent data corruption: the replicas' weights differ at step {step} ({', '.join(tensors[:3])})"
        elements = sum(map(len, positions.values()))
        _replay(job, state, "weights", why, tensors=tensors, positions=positions, values=values)
        job.monitor.event("sdc_mismatch", step=step, tensors=tensors, elements=elements,
                          replay_from=state.sdc_suspect["replay_from"])  # fmt: skip
        return False
    nodes = [job.monitor.hosts[r] for r in verdict.culprits]
    said = ", ".join(f"rank {r} on node {n}" for r, n in zip(verdict.culprits, nodes, strict=True)) or "no rank"
    if pending and pending["kind"] == "gradients":
        reason = f"silent data corruption: {said}: local gradient norm at step {step} did not reproduce on replay"
    else:
        reason = f"silent data corruption: {said} held weights its peers did not at step {step} ({verdict.how})"
    if not verdict.settled:
        where = ", ".join(tensors[:3])
        suspects = said if verdict.culprits else "every rank"
        why = "it recurs in this launch" if repeat else "the replay from the checkpoint did not settle which is wrong"
        raise SDCError(f"silent data corruption at step {step} ({where or 'local gradient norms'}); "
                       f"suspects: {suspects}; {why}")  # fmt: skip
    job.sdc_blamed.update(verdict.culprits)
    for r in verdict.culprits:
        evidence = {"rank": r, "step": step, "tensors": tensors, "decided_by": verdict.how}
        evidence |= {"distances": verdict.distances} if verdict.distances else {}
        if pending and "norms" in pending:
            evidence |= {"norms": safe(norms), "norms_first_pass": safe(pending["norms"])}
        quarantine_rank(job, r, "sdc", reason, evidence)
    rolled = pending["replay_from"] if pending else None
    if verdict.how == "majority":  # the culprits' state goes: every rank back to the checkpoint
        rolled = str(roll_back(job, state, step - 1, reason, rewind=True).ref)
    job.monitor.event("sdc", step=step, ranks=verdict.culprits, nodes=nodes, tensors=tensors,
                      decided_by=verdict.how, distances=verdict.distances, rolled_back_to=rolled)  # fmt: skip
    return verdict.how == "replay"  # a settled replay is this step, verified
