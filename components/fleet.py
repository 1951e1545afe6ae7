"""Which nodes a launch may use. Every finding that a node is bad (preflight's verdict, a
straggler training found) lands in a quarantine record in the store, `_nodes/quarantine/
<node>.json` (node, source, reason, evidence, time, expiry), so the next launch, from any
pod, keeps off the node without a person: preflight and training exclude what is
quarantined; `liftoff nodes` lists and clears the records.

Locally the fleet is this host's simulated nodes, `<host>-node<i>` for i below
`cluster.nodes + cluster.spare_nodes`: a launch takes the first `cluster.nodes` that are not
excluded, and each replica learns its node's name from `NODE_NAMES_ENV` (worker_side). On
Kubernetes the excluded nodes go into the replicas' node anti-affinity (components/k8s.py)."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

QUARANTINE = "_nodes/quarantine"
NODE_NAMES_ENV = "LIFTOFF_NODE_NAMES"  # locally: the nodes of this launch, by replica
REPLICA_ENV = "LIFTOFF_REPLICA"  # locally: this replica's index among them


class FleetError(RuntimeError):
    """Too few nodes are left to launch on."""


@dataclass(frozen=True)
class Quarantine:
    node: str
    source: str  # what found it: preflight, straggler
    reason: str
    at: float  # unix time
    expires: float
    evidence: dict = field(default_factory=dict)

    def line(self, now: float | None = None) -> str:
        left = max(0.0, self.expires - (now or time.time())) / 3600
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(self.at))
        return f"{self.node}  {self.source}  since {stamp} UTC, {left:.1f} h left: {self.reason}"


def _key(node: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in node)
    return f"{QUARANTINE}/{safe}.json"


def quarantine(store, node: str, source: str, reason: str, ttl_s: float, evidence: dict | None = None) -> Quarantine:
    """Record `node` as quarantined for `ttl_s` (a newer finding replaces an older one)."""
    now = time.time()
    record = Quarantine(node, source, reason, now, now + ttl_s, dict(evidence or {}))
    store.backend.put_bytes(_key(node), json.dumps(asdict(record)).encode())
    return record


def quarantined(store, now: float | None = None) -> dict[str, Quarantine]:
    """The records in force, by node; an expired or unreadable record keeps no node out."""
    now = time.time() if now is None else now
    found = {}
    for name in sorted(store.backend.list_sizes(QUARANTINE)):
        try:
            record = _checked(json.loads(store.backend.get_bytes(f"{QUARANTINE}/{name}")))
        except (ValueError, TypeError, KeyError, AttributeError, FileNotFoundError):
            continue  # nothing read from the store is trusted: a record that does not check keeps no node out
        if record.expires > now:
            found[record.node] = record
    return found


def _checked(raw: dict) -> Quarantine:
    record = Quarantine(**raw)
    if not isinstance(record.node, str) or not isinstance(record.evidence, dict):
        raise TypeError("not a quarantine record")
    return Quarantine(
        record.node, str(record.source), str(record.reason), float(record.at), float(record.expires), record.evidence
    )


def clear(store, nodes: list[str] | None = None) -> list[str]:
    """Remove the records of `nodes` (None: every record); the nodes whose record went."""
    records = {r.node: r for r in quarantined(store, now=0.0).values()}  # expired ones too
    gone = sorted(records if nodes is None else set(nodes) & set(records))
    for node in gone:
        store.backend.delete(_key(node))
    return gone


def local_nodes(host: str, nodes: int, spare: int, exclude) -> list[str]:
    """The local fleet's first `nodes` names not excluded; FleetError when too few are left."""
    fleet = [f"{host}-node{i}" for i in range(nodes + spare)]
    chosen = [n for n in fleet if n not in set(exclude)]
    if len(chosen) < nodes:
        out = [n for n in fleet if n in set(exclude)]
        raise FleetError(
            f"{len(chosen)} of this host's {len(fleet)} local nodes are left for cluster.nodes={nodes}: "
            f"{', '.join(out)} excluded (quarantined or unhealthy); raise cluster.spare_nodes={spare}, "
            "or `liftoff nodes --clear NODE`"
        )
    return chosen[:nodes]
