"""A hang is localised (issue 24, acceptance 4): a rank that stalls inside an all-reduce while
its peer waits in it; the stage fails with one line naming the stalled rank, its node and the
collective, within train.watchdog_timeout_s + 60 s; its report and a quarantine of its node
are in the store, and the relaunch runs without that node."""

from __future__ import annotations

import json
import socket
import time

import pytest

from components import fleet
from components.failures import behind
from components.launcher import LaunchError
from components.train.collectives import HANGS
from tests.faults import injected
from tests.helpers import TWO_NODES


@pytest.mark.chaos_slow  # 33 s: in `make chaos`; make test's watchdog test trips a hang
def test_a_rank_stalled_in_an_all_reduce_is_named_with_its_node_and_the_collective(trainer):
    node, spare = f"{socket.gethostname()}-node1", f"{socket.gethostname()}-node2"
    overrides = [
        "train.steps=10",
        "train.watchdog_timeout_s=8",
        "cluster.max_restarts=1",  # one relaunch, which keeps off the node the hang quarantined
        "train.checkpoint_interval=100",
    ]
    with injected(stall_rank=1, stall_step=5), pytest.raises(LaunchError) as failed:
        started, since = time.monotonic(), time.time()
        trainer.run(*TWO_NODES, *overrides)
    assert time.monotonic() - started < 2 * (8 + 60 + 30)  # two attempts, each + the launch and the first steps
    # each rank's report of its hang, in the store, by attempt: where each attempt's ranks ran
    reports = {}
    for key in trainer.store.backend.list_sizes(HANGS):
        record = json.loads(trainer.store.backend.get_bytes(f"{HANGS}/{key}"))
        reports.setdefault(key.split("/")[0].rsplit("-a", 1)[1], {})[record["rank"]] = record
    assert sorted(reports) == ["0", "1"] and "1" in reports["0"], reports  # the stalled rank's own report
    record = reports["0"]["1"]
    assert record["collective"] | {"since": 0} == {
        "seq": 5, "op": "all_reduce", "name": "loss", "step": 5, "phase": "entered", "since": 0
    } and record["node"] == node  # fmt: skip
    assert record["time"] - since < 8 + 60 + 30  # the first attempt's hang, named within the watchdog + 60 s
    # the relaunch ran without the quarantined node: rank 1 on the spare (and stalled there too)
    relaunched = {rank: r["node"] for rank, r in reports["1"].items()}
    assert relaunched.get("1") == spare and node not in relaunched.values(), relaunched
    first = str(failed.value).splitlines()[0]
    said = (
        f"hang: rank 1 on node {spare} is behind: in all_reduce #5 (loss, step 5), not yet in the backend, while rank 0"
    )
    assert said in first and "all_reduce #5" in first.split("while rank 0", 1)[1], first
    # and the loop closes: the next launch keeps off its node; a stall that follows a rank is no node's
    quarantined = fleet.quarantined(trainer.store)
    assert list(quarantined) == [node] and quarantined[node].source == "hang"


def _report(rank, seq, phase):
    collective = {"seq": seq, "op": "all_reduce", "name": "loss", "step": seq, "phase": phase, "since": 0.0}
    return {"rank": str(rank), "node": f"n{rank}", "collective": collective}


def test_the_rank_behind_is_the_one_at_an_earlier_collective_or_not_yet_in_the_backend():
    assert behind([_report(0, 7, "waiting"), _report(1, 6, "done")])["rank"] == "1"
    assert behind([_report(0, 7, "waiting"), _report(1, 7, "entered"), _report(2, 7, "waiting")])["rank"] == "1"
    assert behind([_report(0, 7, "waiting"), _report(1, 7, "waiting")]) is None  # alike: no one is behind
    assert behind([_report(0, 7, "waiting"), {"rank": "1", "type": "RuntimeError"}]) is None  # one report only
    raised = {**_report(1, 6, "done"), "type": "NotFound"}  # behind, but it raised: the first failure, no hang
    assert behind([_report(0, 7, "waiting"), raised]) is None
    # stuck before the backend, then stopped by its agent (a peer's watchdog fired first): still the one behind
    stopped = {**_report(1, 7, "entered"), "type": "SignalException"}
    assert behind([_report(0, 7, "waiting"), stopped])["rank"] == "1"
    malformed = {"rank": "1", "type": "WatchdogTimeout", "collective": {"seq": "7"}}
    assert behind([_report(0, 7, "waiting"), malformed]) is None  # a record that does not check is not read
