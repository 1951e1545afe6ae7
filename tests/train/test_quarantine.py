"""The loop closes (issue 24, acceptance 5): a straggler training finds is quarantined in the
store, and the next launch keeps off its node without a person; `liftoff nodes` lists and
clears the record."""

from __future__ import annotations

import socket

from components import fleet
from components.launcher import build_app
from components.preflight.stage import run_preflight
from components.train.stage import train_launch
from pipelines.cli import main
from tests.faults import injected
from tests.helpers import TWO_NODES


def test_a_straggler_is_quarantined_and_the_next_launch_runs_on_the_spare_node(trainer, capsys):
    node = f"{socket.gethostname()}-node"
    with injected(slow_rank=1, slow_seconds=0.3):
        trainer.run(*TWO_NODES, "train.steps=8", "train.straggler_interval=4", "train.checkpoint_interval=100")
    records = fleet.quarantined(trainer.store)  # what any other pod reads from the store
    assert list(records) == [f"{node}1"], records
    record = records[f"{node}1"]
    assert record.source == "straggler" and record.evidence["rank"] == 1
    assert record.evidence["z"] > record.evidence["threshold"] and record.expires - record.at == 24 * 3600

    # the next run: preflight launches on node 0 and the spare, and hands train the exclusion
    cfg = trainer.config(*TWO_NODES)
    result = run_preflight(
        trainer.dataset, cfg.model, cfg.train, cfg.cluster, cfg.preflight, trainer.store_cfg, trainer.store
    )
    assert sorted(n["host"] for n in result.nodes) == [f"{node}0", f"{node}2"]
    assert result.excluded_hosts == [f"{node}1"] and result.problems == []
    _, _, launch = train_launch(
        trainer.dataset, cfg.model, cfg.train, cfg.cluster, trainer.store_cfg, result.excluded_hosts, cache_gb=1.0
    )
    app = build_app(launch.module, launch.spec, cfg.cluster, launch.name, {}, exclude=launch.exclude_nodes)
    assert app.roles[0].env[fleet.NODE_NAMES_ENV] == f"{node}0,{node}2"

    # a person lets it back
    root = f"store.root={trainer.store_cfg.root}"
    assert main(["nodes", root]) == 0 and f"{node}1  straggler" in capsys.readouterr().out
    assert main(["nodes", "--clear", f"{node}1", root]) == 0
    assert fleet.quarantined(trainer.store) == {}
    assert main(["nodes", "--clear", f"{node}1", root]) == 2  # nothing left to clear: said, exit 2


def test_too_few_nodes_left_is_a_clear_error_before_any_launch():
    import pytest

    with pytest.raises(fleet.FleetError, match=r"1 of this host's 2 local nodes .* h-node0 excluded"):
        fleet.local_nodes("h", 2, 0, ["h-node0"])
    assert fleet.local_nodes("h", 2, 1, ["h-node1"]) == ["h-node0", "h-node2"]


def test_a_record_that_does_not_check_keeps_no_node_out_and_a_fleet_wide_finding_none_in(tmp_path):
    """Nothing read from the store is trusted: malformed records are passed over (and cleared
    by --clear-all); a preflight finding against every node is the config's, not a node's."""
    import json

    from components.config import defaults
    from components.preflight.stage import record_unhealthy
    from components.preflight.verdict import NodeVerdict
    from components.store import open_store

    store = open_store(defaults("store", root=str(tmp_path / "store"), cache_dir=str(tmp_path / "cache")))
    fleet.quarantine(store, "h-node1", "straggler", "slow", 3600)
    store.backend.put_bytes(f"{fleet.QUARANTINE}/bad.json", json.dumps({"node": ["x"], "expires": "soon"}).encode())
    store.backend.put_bytes(f"{fleet.QUARANTINE}/junk.json", b"{not json")
    assert list(fleet.quarantined(store)) == ["h-node1"]
    everyone = [NodeVerdict(0, "h-node0"), NodeVerdict(1, "h-node2")]
    for v in everyone:
        v.fail("gemm_tflops_bf16=1 is below the floor 600 (preflight.floors)")
    record_unhealthy(store, everyone, 24.0)
    assert list(fleet.quarantined(store)) == ["h-node1"]  # floors set too high fail every node: no record
    everyone[0].healthy = True
    record_unhealthy(store, everyone, 24.0)
    assert sorted(fleet.quarantined(store)) == ["h-node1", "h-node2"]
    assert fleet.clear(store) == ["h-node1", "h-node2"] and fleet.quarantined(store) == {}
