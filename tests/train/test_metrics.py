"""Prometheus metrics of a running training, scraped over HTTP like Prometheus does, and the
monitoring files in deploy/ held to what the endpoint serves."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
import urllib.request
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.faults import injected

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "deploy" / "monitoring"


def two_free_ports() -> int:
    """A port p with p + 1 free as well (node 1 serves on p + 1 locally)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports")


def scrape(url: str) -> dict[str, dict[tuple, float]] | None:
    """metric name -> {(rank, node): value}; None while nothing serves there."""
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            text = r.read().decode()
    except OSError:
        return None
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[(s.labels.get("rank"), s.labels.get("node"))] = s.value
    return out


def test_each_node_serves_its_ranks_metrics_over_http_while_training(trainer):
    port = two_free_ports()
    urls = [f"http://127.0.0.1:{port}/metrics", f"http://127.0.0.1:{port + 1}/metrics"]
    done: dict = {}

    def train() -> None:
        try:
            with injected(slow_rank=0, slow_seconds=0.25):  # a steady pace: a few steps a second
                done["result"] = trainer.run(
                    "cluster.nodes=2",
                    "train.steps=24",
                    "train.checkpoint_interval=12",
                    "train.straggler_interval=4",
                    "train.peak_tflops=1.0",  # MFU needs a device peak; CPU has none of its own
                    f"train.metrics_port={port}",
                )
        except BaseException as e:  # the assertion below names it
            done["error"] = e

    thread = threading.Thread(target=train)
    thread.start()
    seen: list[dict] = []  # node 0's scrapes that served a step
    node1 = None
    deadline = time.monotonic() + 240
    while thread.is_alive() and time.monotonic() < deadline:
        first = scrape(urls[0])
        if first and first.get("liftoff_train_step"):
            seen.append(first)
            node1 = scrape(urls[1]) or node1
        if len(seen) >= 2 and _steps(seen[-1])["0"] >= _steps(seen[0])["0"] + 8 and node1:
            break
        time.sleep(0.2)
    thread.join(timeout=300)
    assert "error" not in done, done.get("error")
    assert len(seen) >= 2, "no metrics were served while training ran"
    a, b = seen[0], seen[-1]
    assert _steps(b)["0"] > _steps(a)["0"], "the step counter did not move between scrapes"
    assert _value(b, "liftoff_train_loss", "0") != _value(a, "liftoff_train_loss", "0")
    # each node serves its own rank, labelled with the node it runs on
    assert set(_steps(a)) == {"0"} and set(_steps(node1)) == {"1"}
    nodes = {n for (_, n) in a["liftoff_train_step"]} | {n for (_, n) in node1["liftoff_train_step"]}
    assert len(nodes) == 2 and all(n.endswith(("-node0", "-node1")) for n in nodes)
    assert _value(b, "liftoff_train_tokens_per_second", "0") > 0
    assert _value(b, "liftoff_train_peak_memory_bytes", "0") > 0
    assert 0 < _value(b, "liftoff_train_mfu", "0") < 1
    z = {rank: v for (rank, _), v in b["liftoff_straggler_zscore"].items()}
    assert z["0"] > 5 > z["1"], z  # rank 0 sleeps in every forward (slow_rank): the straggler
    # the endpoints close with the run: nothing left listening
    assert scrape(urls[0]) is None and scrape(urls[1]) is None

    served = set(a) | set(b) | set(node1)
    for name, names in monitoring_metric_names().items():
        assert names, f"{name} names no liftoff metric"
        assert names <= served, f"{name} names metrics the endpoint does not serve: {sorted(names - served)}"


def _steps(scraped: dict) -> dict[str, float]:
    return {rank: v for (rank, _), v in scraped["liftoff_train_step"].items()}


def _value(scraped: dict, name: str, rank: str) -> float:
    return next(v for (r, _), v in scraped[name].items() if r == rank)


def monitoring_metric_names() -> dict[str, set[str]]:
    """Every `liftoff_*` metric the dashboard's queries and the alert rules name."""
    dashboard = json.loads((MONITORING / "dashboard.json").read_text())
    queries = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    queries += [json.dumps(v["query"]) for v in dashboard["templating"]["list"] if "query" in v]
    rules = yaml.safe_load((MONITORING / "alerts.yaml").read_text())
    exprs = [r["expr"] for g in rules["spec"]["groups"] for r in g["rules"]]
    names = lambda texts: {m for t in texts for m in re.findall(r"\bliftoff_[a-z_]+", t)}  # noqa: E731
    return {"dashboard.json": names(queries), "alerts.yaml": names(exprs)}
