"""The shipped monitoring files against the real tools: `promtool` checks the alert rules and runs
their unit tests (a trainer that vanished, one that is stuck, one that finished, a replica that
serves nothing), and every dashboard panel's series are told apart by their legends.
tests/train/test_observability.py scrapes a live training with a real Prometheus."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from tests.prom import ALERTS, promtool, rule_file

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "monitoring" / "dashboard.json"


def series(name: str, run: str, values: str, **labels) -> dict:
    tags = {"run": run, "rank": "0", "node": "gpu-node-3", **labels}
    return {"series": name + "{" + ",".join(f'{k}="{v}"' for k, v in tags.items()) + "}", "values": values}


def run_series(run: str, steps: str, stamps: str, planned: str) -> list[dict]:
    return [
        series("liftoff_train_step", run, steps),
        series("liftoff_train_last_step_timestamp_seconds", run, stamps),
        series("liftoff_train_planned_steps", run, planned),
    ]


STALLED = "LiftoffTrainingStalled"
SUMMARY = "run {run}: no training step for 15 minutes, short of train.steps"
UP = 'up{job="kubeflow/liftoff-train",instance="10.0.4.7:9400",pod="liftoff-train-a1b2-0"}'

UNIT_TESTS = {
    "rule_files": ["alerts.rules.yaml"],
    "evaluation_interval": "1m",
    "tests": [
        {
            "interval": "1m",
            "input_series": [
                # vanished: a step a minute for 10 minutes of 100, then no series at all
                *run_series("vanished", "1+1x10 _x50", "0+60x10 _x50", "100x10 _x50"),
                # stuck: served on, the step at 5 since minute 5
                *run_series("stuck", "1+1x4 5x55", "0+60x4 240x55", "100x60"),
                # finished: its 11 steps of 11, then gone (a completed run is no stall)
                *run_series("finished", "1+1x10 _x50", "0+60x10 _x50", "11x10 _x50"),
                {"series": UP, "values": "1x5 0x20"},  # its trainer died at minute 6; the pod is still there
            ],
            "alert_rule_test": [
                {
                    "eval_time": "21m",
                    "alertname": STALLED,
                    "exp_alerts": [
                        {
                            "exp_labels": {"severity": "critical", "run": "stuck"},
                            "exp_annotations": {"summary": SUMMARY.format(run="stuck")},
                        },
                    ],
                },  # the vanished run's last step is 10 minutes old: not yet  # fmt: skip
                {
                    "eval_time": "40m",
                    "alertname": STALLED,
                    "exp_alerts": [
                        {
                            "exp_labels": {"severity": "critical", "run": run},
                            "exp_annotations": {"summary": SUMMARY.format(run=run)},
                        }
                        for run in ("stuck", "vanished")
                    ],
                },  # fmt: skip
                {"eval_time": "7m", "alertname": "LiftoffTrainerDown", "exp_alerts": []},  # for: 2m
                {
                    "eval_time": "12m",
                    "alertname": "LiftoffTrainerDown",
                    "exp_alerts": [
                        {
                            "exp_labels": {
                                "severity": "critical",
                                "job": "kubeflow/liftoff-train",
                                "instance": "10.0.4.7:9400",
                                "pod": "liftoff-train-a1b2-0",
                            },
                            "exp_annotations": {
                                "summary": "10.0.4.7:9400 (liftoff-train-a1b2-0): the training "
                                "replica serves no metrics"
                            },
                        },
                    ],
                },  # fmt: skip
            ],
        }
    ],
}


def test_promtool_checks_the_shipped_rules_and_their_unit_tests_pass(tmp_path):
    """Issue 43, point 5: the rules load in Prometheus' own checker, and a trainer that vanished
    fires the stall alert (its series gone), as a stuck one does; a finished one does not; a
    replica Prometheus still targets but that serves nothing fires LiftoffTrainerDown."""
    rule_file(tmp_path / "alerts.rules.yaml")
    checked = promtool("check", "rules", "alerts.rules.yaml", cwd=tmp_path)
    assert checked.returncode == 0 and "SUCCESS" in checked.stdout, checked.stdout + checked.stderr
    (tmp_path / "alerts_test.yaml").write_text(yaml.safe_dump(UNIT_TESTS))
    tested = promtool("test", "rules", "alerts_test.yaml", cwd=tmp_path)
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_every_alert_rule_has_a_unit_test_or_a_live_check():
    rules = [r["alert"] for g in yaml.safe_load(ALERTS.read_text())["spec"]["groups"] for r in g["rules"]]
    tested = {t["alertname"] for case in UNIT_TESTS["tests"] for t in case["alert_rule_test"]}
    assert {STALLED, "LiftoffTrainerDown"} <= tested <= set(rules)


def kept_labels(expr: str) -> set[str] | None:
    """The labels an expression's result keeps: those of its outermost `by (...)`; None: all of
    the series' (no aggregation)."""
    found = re.findall(r"\bby \(([^)]*)\)", expr)
    return {x.strip() for x in found[0].split(",")} if found else None


def test_each_dashboard_panels_series_have_distinct_legends_from_labels_they_keep():
    """Issue 43, point 5: no two targets of a panel share a legend, and a legend names only
    labels its query keeps (`{{rank}}` after `max by (run)` is empty: every target looked alike)."""
    dashboard = json.loads(DASHBOARD.read_text())
    for panel in dashboard["panels"]:
        targets = panel.get("targets", [])
        legends = [t.get("legendFormat", "") for t in targets]
        assert len(set(legends)) == len(legends), (panel["title"], legends)
        for t in targets:
            kept = kept_labels(t["expr"])
            used = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", t.get("legendFormat", "")))
            assert used, (panel["title"], t["expr"], "a legend names no label")
            if kept is not None:
                assert used <= kept, (panel["title"], t["expr"], sorted(used - kept))
