"""What a job's replica logs say about its failure: which rank failed first and why, from each
rank's own `rank_failed` event or else torchrun's "Root Cause" block, and the log tail worth
quoting. The launcher (`components/launcher.py`) raises what `describe_failure` writes."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

from components import events
from components.worker_side import RANK_FAILED


def describe_failure(
    name: str, status, tails: dict, tail_lines: int, failures: dict | None = None
) -> tuple[str, str, dict | None]:
    """(the cause in one line, the message, the report of the rank a hang waited for) of a job
    that did not succeed: the rank that failed first (or the failing replica's own exception),
    then its replica's last log lines, quoted."""
    state = status.state.name if status else "UNKNOWN"
    ranked = first_failures(tails, failures or {})
    if ranked:  # the rank that failed first is the cause; the others failed after it
        first, *after = ranked
        seen = list(tails.get(first.replica, []))
        head = f"{name} ended {state}; first failure: {first.describe()}"
        records = [f.record for f in ranked if f.record]
        culprit = behind(records)
        if culprit is not None:  # a hang: name the rank the others wait for
            head = f"{name} ended {state}; hang: {hang_line(culprit, records)}; first failure: {first.describe()}"
        if after:
            head += " (" + "; ".join(f"{f.who()} failed after it: {f.brief()}" for f in after) + ")"
        # a replica whose log names no failure at all: its processes died without a word
        # (SIGKILLed with their agent, a lost node or pod), or were stopped before they noticed
        silent = sorted({*tails, *_failed_replicas(status)} - {f.replica for f in ranked})
        if silent:
            which = ", ".join(map(str, silent))
            head += f"; replica {which} logged no error (its processes killed, or its node lost?)"
    else:
        culprit = None
        failing = _failing_replica(status)
        seen = list(tails.get(failing, [])) if failing is not None else [ln for k in sorted(tails) for ln in tails[k]]
        cause = root_cause(seen)
        head = (
            f"{name} ended {state}"
            + (f"; replica {failing} failed" if failing is not None else "")
            + (f": {cause}" if cause else "")
        )
    quoted = "\n".join(f"  | {ln}" for ln in log_tail(seen, tail_lines))  # quoted: never read as the driver's own
    return head, f"{head}; last log lines:\n{quoted}", culprit


@dataclass(frozen=True)
class Failure:
    """One rank's failure as its replica's log tells it: its own `rank_failed` event (exact
    time, the exception), else torchrun's "Root Cause" block (the second its agent saw the
    process end: a signal, or an exception from the error file `@record` wrote)."""

    replica: int
    rank: str
    time: float
    cause: str  # `Type: message`, or how the process ended
    exact: bool = True  # False: torchrun's time, in whole seconds
    order: float | None = None  # the time it is ranked by (see `torchrun_root_causes`); None: `time`
    record: dict | None = field(default=None, compare=False)  # its own report, where it has one

    def __post_init__(self):
        if self.order is None:
            object.__setattr__(self, "order", self.time)

    def who(self) -> str:
        return f"replica {self.replica} rank {self.rank}"

    def describe(self) -> str:
        clock = time.strftime("%H:%M:%S", time.localtime(self.time))
        clock += f".{int(self.time * 1000) % 1000:03d}" if self.exact else ""
        return f"{self.who()} at {clock}: {self.cause}"

    def brief(self, n: int = 120) -> str:
        # gloo's source location in front of its message says nothing to a user
        text = re.sub(r"^(\w+: )\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\] ", r"\1", self.cause)
        text = re.split(r"(?<=\.) (?=[A-Z])", text, maxsplit=1)[0]  # its first sentence
        return text if len(text) <= n else text[: n - 3].rstrip() + "..."


# a process that died of these died on its own (the kernel's OOM killer, a crash); a SIGTERM
# or SIGINT is someone stopping it (its agent after a peer failed, a cancel)
_OWN_DEATH = ("SIGKILL", "SIGSEGV", "SIGABRT", "SIGBUS", "SIGFPE", "SIGILL")


def _failure_record(line: str) -> dict | None:
    """The record a `report_failure` line carries."""
    event = events.parse(line)
    return dict(event.fields) if event is not None and event.kind == RANK_FAILED else None


def _reported_failure(replica: int, line: str) -> Failure | None:
    r = _failure_record(line)
    if r is None:
        return None
    try:
        cause = events.one_line(f"{r['type']}: {r['message']}")
        return Failure(replica, str(r["rank"]), float(r["time"]), cause, record=r)
    except (ValueError, KeyError, TypeError):
        return None


# what the Kubernetes API puts before each line of a pod's log (TorchX asks for timestamps)
_POD_LOG_TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?(?:Z|[+-]\d\d:\d\d) ")
_ROOT_CAUSE_FIELD = re.compile(r"^\s{2}(time|rank|exitcode|error_file|traceback)\s*: ?(.*)$")


def torchrun_root_causes(replica: int, lines: list[str]) -> list[Failure]:
    """The "Root Cause (first observed failure)" blocks torchrun's agent printed in this replica's log."""
    from datetime import datetime

    lines = [_POD_LOG_TIME.sub("", ln) for ln in lines]
    found = []
    for i, line in enumerate(lines):
        if "Root Cause (first observed failure):" not in line:
            continue
        fields: dict[str, list[str]] = {}
        key = None
        for ln in lines[i + 2 :]:
            if re.match(r"^\s*=+\s*$", ln) or re.match(r"^\[\d+\]:", ln):
                break
            m = _ROOT_CAUSE_FIELD.match(ln)
            if m:
                key = m.group(1)
                fields[key] = [m.group(2)]
            elif key == "traceback":
                fields[key].append(ln[2:] if ln.startswith("  ") else ln)
        try:
            when = datetime.strptime(fields["time"][0].strip(), "%Y-%m-%d_%H:%M:%S").timestamp()
            rank = fields["rank"][0].split()[0]
        except (KeyError, IndexError, ValueError):
            continue
        exitcode = " ".join(fields.get("exitcode", ["?"])[0].split())
        signal_name = re.search(r"\((SIG\w+)\)", exitcode)
        code = exitcode.split()[0] if exitcode else "?"
        cause = _traceback_exception(fields.get("traceback", []))
        # Ranked against the exact times of the ranks' own reports: an exception from the
        # error file happened within its (floored) second; a process that died on its own,
        # with no exception, counts as first against exceptions up to a second later (what
        # its peers take to notice: a lost connection, a timeout); one that was stopped, or
        # exited without an exception, comes after whatever happened in its second
        if cause is not None:
            order = when + 0.5
        elif signal_name:
            cause = f"killed by {signal_name.group(1)} (exit code {code})"
            order = when - 1.0 if signal_name.group(1) in _OWN_DEATH else when + 1.0
        else:  # an exit without an exception (a watchdog's names itself in its own rank_failed event)
            cause, order = f"exit code {code}", when + 1.0
        found.append(Failure(replica, rank, when, cause, exact=False, order=order))
    return found


def _traceback_exception(lines: list[str]) -> str | None:
    """`Type: message` of a printed traceback: the first unindented line after the frames of
    its last (outermost) exception, and the message's lines up to the next blank one."""
    if not lines or not lines[0].startswith("Traceback (most recent"):
        return None
    last = max(i for i, ln in enumerate(lines) if ln.startswith("Traceback (most recent"))
    rest = lines[last + 1 :]
    start = next((i for i, ln in enumerate(rest) if ln and not ln[0].isspace()), None)
    if start is None:
        return None
    kind, _, message = rest[start].partition(": ")
    body = [message]
    for ln in rest[start + 1 :]:
        if not ln.strip():
            break
        body.append(ln)
    return events.one_line(f"{kind.rsplit('.', 1)[-1]}: " + "\n".join(body))


# where a rank is in one of liftoff's collectives, in order (components/train/collectives.py
# sets them): not yet in the backend, waiting in it for its peers, done
ENTERED, WAITING, DONE = "entered", "waiting", "done"
_PHASES = {ENTERED: 0, WAITING: 1, DONE: 2}


def behind(records: list[dict]) -> dict | None:
    """Of hung ranks' reports (each with the `collective` it is in), the one rank behind the
    others: at an earlier collective, or at the same one but not yet in the backend while they
    wait in it. None when no one rank is behind (all alike, or too few reports)."""
    known = [r for r in records if isinstance(r.get("collective"), dict) and _well_formed(r["collective"])]
    if len(known) < 2:
        return None
    key = lambda r: (r["collective"]["seq"], _PHASES.get(r["collective"]["phase"], 3))  # noqa: E731
    first, second = sorted(known, key=key)[:2]
    # a rank that raised did not hang; one stuck before the backend did, however it was ended
    hung = first.get("type", "WatchdogTimeout") == "WatchdogTimeout" or first["collective"]["phase"] == ENTERED
    return first if hung and key(first) < key(second) else None


def _well_formed(c: dict) -> bool:
    return isinstance(c.get("seq"), int) and c.get("phase") in _PHASES and all(k in c for k in ("op", "name", "step"))


def hang_line(culprit: dict, records: list[dict]) -> str:
    """`rank 1 on node h-node1 is behind: in all_reduce #9 (loss, step 9), not yet in the backend,
    while rank 0 waits in all_reduce #9`."""
    c = culprit["collective"]
    where = "not yet in the backend" if c["phase"] == ENTERED else c["phase"]
    others = [r for r in records if r is not culprit and isinstance(r.get("collective"), dict)]
    waits = "; ".join(
        f"rank {r['rank']} {r['collective']['phase']} in {r['collective']['op']} #{r['collective']['seq']}"
        for r in others
    )
    return (
        f"rank {culprit['rank']} on node {culprit.get('node', '?')} is behind: in {c['op']} #{c['seq']} "
        f"({c['name']}, step {c['step']}), {where}, while {waits}"
    )


def first_failures(tails: dict, reported: dict) -> list[Failure]:
    """Every rank that failed, first first: each rank's own report where its log has one, else
    what torchrun's agent saw of it. Empty when no replica's log names a failed rank."""
    by_rank: dict[str, Failure] = {}
    for k in sorted(tails):
        for f in torchrun_root_causes(k, list(tails[k])):
            by_rank.setdefault(f.rank, f)
    for k in sorted(reported):
        for f in reported[k]:
            if f.rank not in by_rank or not by_rank[f.rank].exact:
                by_rank[f.rank] = f
    return sorted(by_rank.values(), key=lambda f: (f.order, f.replica))


# torchrun's C++ stack frames and banners after a worker died: they push the worker's own
# last words (its exception, the watchdog's thread dump) out of any fixed-size tail
_NOISE = re.compile(r"^(frame #\d+:|Exception raised from |=+$|\[W\d+ |\s*\^+$)")


def log_tail(lines: list[str], n: int) -> list[str]:
    """The last `n` meaningful lines; a watchdog's thread dump is kept whole (capped at 3n)
    because the stacks are the one thing that explains a hang."""
    kept, dump = [], None
    for ln in lines:
        record = _failure_record(ln)
        if record is not None and record.get("stacks_follow"):  # the newest dump is the one kept whole
            dump = len(kept)
            kept.append(f"rank {record.get('rank')}: {record.get('type')}: {record.get('message')}; its stacks:")
        elif not _NOISE.match(ln) and events.parse(ln) is None:  # events are for programs
            kept.append(ln)
    if dump is None:
        return kept[-n:]
    end = dump + 3 * n
    return kept[dump:end] + (["..."] if len(kept) > end else []) + kept[max(end, len(kept) - n) :]


def root_cause(lines: list[str]) -> str | None:
    """The worker's own exception line (`SomeError: message`), not torchrun's wrapper."""
    for line in reversed(lines):
        m = re.search(r"\b(\w+(?:Error|Exception)): (.+)$", line)
        if m and m.group(1) not in ("ChildFailedError",):
            return f"{m.group(1)}: {m.group(2).strip()}"
    return None


def _failing_replica(status) -> int | None:
    return next(iter(_failed_replicas(status)), None)


def _failed_replicas(status) -> list[int]:
    if status is None:
        return []
    return [r.id for role in status.roles for r in role.replicas if r.state.name == "FAILED"]
