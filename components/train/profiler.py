"""On-demand profiling of a running training (`liftoff profile`).

The request is one small object in the store, `_requests/profile/<identity>.json`: {id, steps,
requested_at, by}. Every `train.profile_poll_steps` steps rank 0 reads it (one GET; nothing
else in the step touches the store) and broadcasts what it found; every rank then traces the
next `steps` steps with torch.profiler. Each rank uploads its own Chrome trace (gzipped,
`rank<r>.pt.trace.json.gz`: Perfetto and TensorBoard's profiler open it) and op summary; rank 0
adds a merged HTML summary (top ops per rank, communication against compute), commits the
`profile/<model>@<identity>-s<step>-<id>` version with the dataset as its parent, and marks the
request served with that ref, which is what `liftoff profile` waits for. A profile that cannot
be published is logged and training goes on: profiling never stops a run.
"""

from __future__ import annotations

import gzip
import json
import logging
import re
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from components import page
from components.store import ArtifactStore, NotFound, Ref, check_part

log = logging.getLogger(__name__)

REQUESTS = "_requests/profile"
# ops that are communication: collectives of every backend, and waiting on them
COMM = re.compile(r"nccl|gloo|c10d|all_?reduce|all_?gather|reduce_?scatter|broadcast|barrier|all_to_all", re.I)
TOP_OPS = 15


def request_key(identity: str) -> str:
    return f"{REQUESTS}/{check_part(identity, 'training identity')}.json"


def ask(store: ArtifactStore, identity: str, steps: int, by: str) -> dict:
    """Write a profile request for the training of `identity` (replacing an unserved one)."""
    if steps < 1:
        raise ValueError(f"--steps {steps}: must be >= 1")
    request = {"id": uuid.uuid4().hex[:12], "steps": steps, "requested_at": time.time(), "by": by}
    store.backend.put_bytes(request_key(identity), json.dumps(request).encode())
    return request


def read_request(store: ArtifactStore, identity: str) -> tuple[dict | None, bytes | None]:
    """(the request, its raw bytes); (None, None) when there is none or it is unreadable."""
    try:
        raw = store.backend.get_bytes(request_key(identity))
        request = json.loads(raw)
        int(request["steps"]), str(request["id"])
        return request, raw
    except (NotFound, ValueError, KeyError, TypeError):
        return None, None


@dataclass
class _Active:
    request: dict
    raw: bytes | None  # rank 0: the request as read, for the compare-and-swap that marks it served
    start: int
    profile: torch.profiler.profile


class Profiler:
    """Every rank: `on_step(step)` as each step starts (a `Job.on_step` hook), `settled(step)` after
    the loop settled a step, `close(step)` at the end."""

    def __init__(self, store, identity: str, model_name: str, dataset: str, rank: int, poll_steps: int, device):
        self.store, self.identity, self.model_name, self.dataset = store, identity, model_name, dataset
        self.rank, self.poll_steps, self.device = rank, poll_steps, device
        self.active: _Active | None = None
        self.served: set[str] = set()
        self.published: list[str] = []  # refs of the profiles this run published (rank 0)
        self.polled = -poll_steps  # the step of the last look: the first settled step looks

    def on_step(self, step: int) -> None:
        if self.active is not None and step >= self.active.start + int(self.active.request["steps"]):
            self._finish(step)

    def settled(self, step: int) -> None:
        """After the loop settled `step` (its device values read back: the queue is empty): look
        for a request once `train.profile_poll_steps` steps have passed since the last look, and
        trace from the next step. Never between settling steps: the broadcast of what rank 0
        found reads a device tensor's size back on a GPU (the launch queue would drain)."""
        if self.active is None and step - self.polled >= self.poll_steps:
            self.polled = step
            found = [self._poll() if self.rank == 0 else None]
            dist.broadcast_object_list(found, src=0)  # every rank starts at the same step
            if found[0] is not None:
                request, raw = found[0]
                self._start(request, raw if self.rank == 0 else None, step + 1)

    def close(self, step: int) -> None:
        """The run ends inside a profile: publish the steps traced so far (every rank)."""
        if self.active is not None:
            self._finish(step + 1)

    def _poll(self) -> tuple[dict, bytes] | None:
        try:
            request, raw = read_request(self.store, self.identity)
        except Exception as e:  # an unreachable store must not stop training: the next poll retries
            log.warning("profile request unreadable: %s", e)
            return None
        if request is None or "served" in request or request["id"] in self.served:
            return None
        return request, raw

    def _start(self, request: dict, raw: bytes | None, step: int) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profile = torch.profiler.profile(activities=activities, record_shapes=True)
        profile.start()
        self.active = _Active(request, raw, step, profile)
        if self.rank == 0:
            log.info("profiling steps %d-%d (request %s)", step, step + int(request["steps"]) - 1, request["id"])

    def _finish(self, step: int) -> None:
        active, self.active = self.active, None
        active.profile.stop()
        self.served.add(active.request["id"])
        steps = step - active.start
        ref = Ref("profile", self.model_name, f"{self.identity}-s{active.start}-{active.request['id']}")
        staging = Path(tempfile.mkdtemp(prefix="liftoff-profile-"))
        try:
            mine, error = self._upload_own(active.profile, ref, staging, steps)
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, (mine, error))
            if self.rank == 0:
                self._commit(ref, active, steps, gathered, staging)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def _upload_own(self, profile, ref: Ref, staging: Path, steps: int) -> tuple[dict | None, str | None]:
        try:
            trace = staging / f"rank{self.rank}.pt.trace.json"
            profile.export_chrome_trace(str(trace))
            packed = trace.with_name(trace.name + ".gz")
            with open(trace, "rb") as src, gzip.open(packed, "wb", compresslevel=6) as dst:
                shutil.copyfileobj(src, dst)
            trace.unlink()
            summary = summarize(profile, self.rank, steps, self.device.type == "cuda")
            (staging / f"rank{self.rank}.summary.json").write_text(json.dumps(summary, indent=2))
            files = {p.name: p for p in staging.iterdir()}
            return {"entries": self.store.upload(ref, files), "summary": summary}, None
        except Exception as e:  # reported by rank 0; training goes on
            return None, f"rank {self.rank}: {type(e).__name__}: {e}"

    def _commit(self, ref: Ref, active: _Active, steps: int, gathered: list, staging: Path) -> None:
        errors = [e for _, e in gathered if e]
        if errors:
            log.warning("profile %s not published: %s", ref, "; ".join(errors))
            return
        summaries = [g["summary"] for g, _ in gathered]
        entries = {k: v for g, _ in gathered for k, v in g["entries"].items()}
        rows = {
            "training run": self.identity,
            "profile": str(ref),
            "steps": f"{active.start}-{active.start + steps - 1} ({steps})",
            "ranks": str(len(summaries)),
            "request": f"{active.request['id']} by {active.request.get('by', '?')}",
            "device": self.device.type,
        }
        summary_page = staging / "summary.html"
        summary_page.write_text(summary_html(rows, summaries))
        try:
            entries.update(self.store.upload(ref, {"summary.html": summary_page}))
            metadata = {
                "identity": self.identity,
                "start_step": active.start,
                "steps": steps,
                "world": len(summaries),
                "request": active.request,
                "ranks": [{k: s[k] for k in ("rank", "self_s", "comm_s", "compute_s")} for s in summaries],
            }
            self.store.commit(ref, entries, metadata=metadata, parents=[self.dataset])
            served = {**active.request, "served": str(ref), "served_at": time.time()}
            if active.raw is not None:  # a newer request replaced it meanwhile: that one stays pending
                self.store.backend.replace_bytes_if(request_key(self.identity), active.raw, json.dumps(served).encode())
            self.published.append(str(ref))
            log.info("published profile %s (%d steps, %d ranks)", ref, steps, len(summaries))
        except Exception as e:
            log.warning("profile %s not published: %s", ref, e)


def summarize(profile, rank: int, steps: int, cuda: bool) -> dict:
    """The rank's top ops by self time, and its self time split into communication and compute."""
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = [e for e in profile.key_averages() if not e.key.startswith("ProfilerStep")]
    total_us = sum(getattr(e, attr, 0.0) for e in events)
    comm_us = sum(getattr(e, attr, 0.0) for e in events if COMM.search(e.key))
    top = sorted(events, key=lambda e: getattr(e, attr, 0.0), reverse=True)[:TOP_OPS]
    return {
        "rank": rank,
        "steps": steps,
        "time": "device" if cuda else "cpu",
        "self_s": total_us / 1e6,
        "comm_s": comm_us / 1e6,
        "compute_s": (total_us - comm_us) / 1e6,
        "top_ops": [
            {"op": e.key, "calls": e.count, "self_s": getattr(e, attr, 0.0) / 1e6, "comm": bool(COMM.search(e.key))}
            for e in top
        ],
    }


def summary_html(rows: dict[str, str], summaries: list[dict]) -> str:
    """Every rank side by side: communication against compute, then the top ops' self time per rank."""
    split = [
        [f"rank {s['rank']}", s["self_s"], s["compute_s"], s["comm_s"], s["comm_s"] / s["self_s"] if s["self_s"] else 0]
        for s in summaries
    ]
    ops: dict[str, dict[int, float]] = {}
    for s in summaries:
        for op in s["top_ops"]:
            ops.setdefault(op["op"], {})[s["rank"]] = op["self_s"]
    ranked = sorted(ops, key=lambda o: -max(ops[o].values()))[:TOP_OPS]
    op_rows = [[o, *(ops[o].get(s["rank"], 0.0) for s in summaries)] for o in ranked]
    ranks = [f"rank {s['rank']}" for s in summaries]
    body = [
        page.header(f"Profile of {rows['training run']}", rows),
        page.section(
            "split",
            "Communication and compute (self time, seconds)",
            page.table(["rank", "self s", "compute s", "comm s", "comm share"], split),
        ),
        page.section("ops", "Top ops by self time (seconds)", page.table(["op", *ranks], op_rows)),
    ]
    return page.page(f"liftoff profile: {rows['profile']}", body, json.dumps(summaries))
