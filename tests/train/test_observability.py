"""A running local 2-node training watched from outside, as an operator would: its Prometheus
endpoints scraped over HTTP while it trains, and `liftoff profile` asked to trace it. One
training serves both tests (module fixture); the monitoring files in deploy/ are held to what
the endpoints served."""

from __future__ import annotations

import gzip
import json
import math
import re
import socket
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from components.plots import read_records
from components.store import Ref
from pipelines.cli import main
from pipelines.profile import running_trainings
from tests.conftest import Trainer
from tests.faults import injected
from tests.prom import JOB, Prometheus

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


@pytest.fixture(scope="module")
def watched(dataset_store, tmp_path_factory):
    trainer = Trainer(dataset_store, tmp_path_factory.mktemp("watched"))
    port = two_free_ports()
    urls = [f"http://127.0.0.1:{port}/metrics", f"http://127.0.0.1:{port + 1}/metrics"]
    targets = [f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"]  # a real Prometheus scrapes them too
    with Prometheus(tmp_path_factory.mktemp("prometheus"), targets) as prometheus:
        yield run_watched(trainer, port, urls) | {"prometheus": prometheus}


def run_watched(trainer: Trainer, port: int, urls: list[str]) -> dict:
    done: dict = {"scrapes": [], "node1": []}

    def train() -> None:
        try:
            with injected(slow_rank=0, slow_seconds=0.25):  # a steady pace: a few steps a second
                done["result"] = trainer.run(
                    "cluster.nodes=2",
                    "train.steps=30",
                    "train.checkpoint_interval=15",
                    "train.straggler_interval=4",
                    "train.peak_tflops=1.0",  # MFU needs a device peak; CPU has none of its own
                    f"train.metrics_port={port}",
                    "train.profile_poll_steps=2",
                )
        except BaseException as e:  # the tests name it
            done["error"] = e

    def watch() -> None:  # Prometheus' part: scrape every node while the training runs
        while thread.is_alive():
            if (first := scrape(urls[0])) and first.get("liftoff_train_step"):
                done["scrapes"].append(first)
            if (second := scrape(urls[1])) and second.get("liftoff_train_step"):
                done["node1"].append(second)
            time.sleep(0.2)

    thread = threading.Thread(target=train)
    thread.start()
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        deadline = time.monotonic() + 180
        while not running_trainings(trainer.store) and time.monotonic() < deadline and thread.is_alive():
            time.sleep(0.2)
        store = [f"store.root={trainer.store_cfg.root}", f"store.cache_dir={trainer.store_cfg.cache_dir}"]
        done["profile_rc"] = main(["profile", "--steps", "3", "--timeout", "120", *store])
    finally:
        thread.join(timeout=300)
        watcher.join(timeout=30)
    done["after"] = [scrape(u) for u in urls]
    done.update(trainer=trainer, urls=urls)
    return done


def _steps(scraped: dict) -> dict[str, float]:
    return {rank: v for (rank, _), v in scraped["liftoff_train_step"].items()}


def _value(scraped: dict, name: str, rank: str) -> float:
    return next(v for (r, _), v in scraped[name].items() if r == rank)


def test_each_node_serves_its_ranks_metrics_over_http_while_training(watched):
    """Issue 25, acceptance 1: the step counter and the loss change between scrapes; each node's
    endpoint serves its own rank, labelled with its node; the endpoints close with the run."""
    assert "error" not in watched, watched.get("error")
    scrapes, node1 = watched["scrapes"], watched["node1"]
    assert len(scrapes) >= 2 and node1, "no metrics were served while training ran"
    a, b = scrapes[0], scrapes[-1]
    assert _steps(b)["0"] > _steps(a)["0"], "the step counter did not move between scrapes"
    assert _value(b, "liftoff_train_loss", "0") != _value(a, "liftoff_train_loss", "0")
    assert set(_steps(a)) == {"0"} and {r for n in node1 for r in _steps(n)} == {"1"}
    nodes = {n for (_, n) in a["liftoff_train_step"]} | {n for (_, n) in node1[-1]["liftoff_train_step"]}
    assert len(nodes) == 2 and all(n.endswith(("-node0", "-node1")) for n in nodes)
    assert _value(b, "liftoff_train_tokens_per_second", "0") > 0
    assert _value(b, "liftoff_train_peak_memory_bytes", "0") > 0
    assert 0 < _value(b, "liftoff_train_mfu", "0") < 1
    z = {rank: v for (rank, _), v in b["liftoff_straggler_zscore"].items()}
    assert z["0"] > 5 > z["1"], z  # rank 0 sleeps in every forward (slow_rank): the straggler
    assert watched["after"] == [None, None]  # nothing left listening

    # every value served is the one metrics.jsonl recorded for the step served
    assert_served_as_recorded(scrapes, node1, watched["result"].metrics)

    served = {name for s in [*scrapes, *node1] for name in s}
    for name, names in monitoring_metric_names().items():
        assert names, f"{name} names no liftoff metric"
        assert names <= served, f"{name} names metrics the endpoint does not serve: {sorted(names - served)}"


# each served gauge -> the key of metrics.jsonl's step record it serves (spelled out here, not
# read off the exporter: a gauge serving the wrong key must show)
RECORDED_AS = {
    "liftoff_train_step": "step",
    "liftoff_train_loss": "loss",
    "liftoff_train_grad_norm": "grad_norm",
    "liftoff_train_lr": "lr",
    "liftoff_train_tokens_per_second": "tokens_per_s",
    "liftoff_train_mfu": "mfu",
    "liftoff_train_step_seconds": "step_s",
    "liftoff_train_forward_seconds": "forward_s",
    "liftoff_train_comm_seconds": "comm_s",
    "liftoff_train_data_seconds": "data_s",
    "liftoff_train_optimizer_seconds": "optimizer_s",
    "liftoff_train_peak_memory_bytes": "peak_memory_bytes",
    "liftoff_train_skipped_steps": "skipped_steps",
    "liftoff_checkpoint_blocking_seconds": "checkpoint_blocking_s",
    "liftoff_checkpoint_background_seconds": "checkpoint_background_s",
    "liftoff_train_last_step_timestamp_seconds": "time",
}
# the same on every rank (all-reduced, or the job's), so rank 1's are rank 0's records' too
JOB_WIDE = {"liftoff_train_step", "liftoff_train_loss", "liftoff_train_grad_norm", "liftoff_train_lr",
            "liftoff_train_skipped_steps"}  # fmt: skip
SPIKES = "liftoff_train_loss_spikes_total"  # counts metrics.jsonl's loss_spike events
PLANNED = ("liftoff_train_planned_steps", 30)  # train.steps, served from the start
# metrics.jsonl has straggler verdicts, not z-scores; val losses in val records, not in step records
UNRECORDED = {"liftoff_straggler_zscore", "liftoff_val_loss"}


def _same(served: float, recorded) -> bool:
    return served == float(recorded) or (math.isnan(served) and math.isnan(float(recorded)))


def assert_served_as_recorded(node0: list[dict], node1: list[dict], metrics: Path) -> None:
    """Each scrape of a rank holds one step's values: the step record of metrics.jsonl with the
    served step number. Rank 0's every served gauge is its record's value, exactly (the record
    is what rank 0 both writes and serves); rank 1's job-wide ones are too; the spike counter
    counts the loss_spike events up to that step. A scrape read while the rank was setting its
    gauges (step first, last-step timestamp last) mixes two steps: it is left out, by its
    timestamp, which rank 1 shares with rank 0's record to within the collective of the step."""
    steps, events = read_records(metrics)
    by_step = {r["step"]: r for r in steps}
    spike_steps = [e["step"] for e in events if e["kind"] == "loss_spike"]
    stamp = "liftoff_train_last_step_timestamp_seconds"
    for rank, scraped in (("0", node0), ("1", node1)):
        compared = 0
        for s in scraped:
            mine = {name: v for name, series in s.items() for (r, _), v in series.items() if r == rank}
            unknown = set(mine) - set(RECORDED_AS) - {SPIKES, PLANNED[0]} - UNRECORDED
            assert not unknown, f"served metrics this test does not hold to metrics.jsonl: {sorted(unknown)}"
            step = int(mine["liftoff_train_step"])
            record = by_step.get(step)
            assert record is not None, f"rank {rank} served step {step}; metrics.jsonl has no record of it"
            nearest = min(steps, key=lambda r: abs(r["time"] - mine[stamp]))["step"]
            if (mine[stamp] != record["time"]) if rank == "0" else (nearest != step):
                continue  # read halfway through the rank's update of its gauges
            names = set(RECORDED_AS) if rank == "0" else JOB_WIDE
            assert names <= set(mine), f"rank {rank} serves none of {sorted(names - set(mine))}"
            for name in sorted(names):
                key = RECORDED_AS[name]
                assert _same(mine[name], record[key]), (
                    f"rank {rank} served {name}={mine[name]!r} at step {step}; metrics.jsonl has {key}={record[key]!r}"
                )
            assert mine[PLANNED[0]] == PLANNED[1], (rank, mine[PLANNED[0]])
            spikes = (sum(x <= step for x in spike_steps), sum(x <= step + 1 for x in spike_steps))
            assert spikes[0] <= mine[SPIKES] <= spikes[1], (rank, step, mine[SPIKES], spike_steps)
            compared += 1
        assert compared >= max(1, len(scraped) // 2), f"rank {rank}: {compared} of {len(scraped)} scrapes held one step"


def test_a_real_prometheus_scraping_the_training_stored_what_metrics_jsonl_recorded(watched):
    """Issue 43, acceptance 4: Debian's Prometheus scraped both nodes every 500 ms while the
    training ran; its query API returns rank 0's loss series, and at every scrape that read one
    step whole (its last-step time is that record's) the loss is metrics.jsonl's, exactly; the
    series carry the run's identity; now the run is over, its targets are down and the
    LiftoffTrainerDown rule's expression selects both."""
    assert "error" not in watched, watched.get("error")
    prometheus, result = watched["prometheus"], watched["result"]
    steps, _ = read_records(result.metrics)
    by_step = {r["step"]: r for r in steps}

    def samples(name: str) -> dict[float, float]:
        (series,) = prometheus.query(f'{name}{{job="{JOB}",rank="0"}}[30m]')
        assert series["metric"]["run"] == result.identity, series["metric"]
        return {float(t): float(v) for t, v in series["values"]}

    step, loss = samples("liftoff_train_step"), samples("liftoff_train_loss")
    stamp = samples("liftoff_train_last_step_timestamp_seconds")
    whole = [t for t in step if t in loss and t in stamp and stamp[t] == by_step[int(step[t])]["time"]]
    assert len({step[t] for t in whole}) >= 3, f"{len(step)} scrapes, {len(whole)} of one whole step"
    for t in whole:
        assert loss[t] == by_step[int(step[t])]["loss"], (step[t], loss[t], by_step[int(step[t])]["loss"])
    planned = prometheus.query("max_over_time(liftoff_train_planned_steps[30m])")  # stale: the run is over
    assert sorted((s["metric"]["rank"], float(s["value"][1])) for s in planned) == [("0", 30.0), ("1", 30.0)]
    rules = yaml.safe_load((MONITORING / "alerts.yaml").read_text())["spec"]["groups"][0]["rules"]
    down = next(r["expr"] for r in rules if r["alert"] == "LiftoffTrainerDown")
    deadline = time.monotonic() + 30
    while len(prometheus.query(down)) < 2 and time.monotonic() < deadline:
        time.sleep(0.5)  # the first scrape that finds nothing listening
    assert sorted(s["metric"]["instance"] for s in prometheus.query(down)) == sorted(
        u.split("/")[2] for u in watched["urls"]
    )


def monitoring_metric_names() -> dict[str, set[str]]:
    """Every `liftoff_*` metric the dashboard's queries and the alert rules name."""
    dashboard = json.loads((MONITORING / "dashboard.json").read_text())
    queries = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    queries += [json.dumps(v["query"]) for v in dashboard["templating"]["list"] if "query" in v]
    rules = yaml.safe_load((MONITORING / "alerts.yaml").read_text())
    exprs = [r["expr"] for g in rules["spec"]["groups"] for r in g["rules"]]
    names = lambda texts: {m for t in texts for m in re.findall(r"\bliftoff_[a-z_]+", t)}  # noqa: E731
    return {"dashboard.json": names(queries), "alerts.yaml": names(exprs)}


def test_liftoff_profile_traces_every_rank_of_a_running_training_into_the_store(watched):
    """Issue 25, acceptance 2: the profile artifact holds a Chrome trace per rank with aten ops,
    its lineage names the dataset, and the training went on to its last step."""
    assert "error" not in watched, watched.get("error")
    assert watched["profile_rc"] == 0
    trainer, result = watched["trainer"], watched["result"]
    (manifest,) = trainer.store.ls("profile")
    assert manifest.metadata["steps"] == 3 and manifest.metadata["world"] == 2
    assert manifest.parents == [trainer.dataset]
    assert manifest.metadata["identity"] == result.identity
    folder = trainer.store.fetch(Ref.parse(str(manifest.ref)))  # every file checked against its sha256
    for rank in (0, 1):
        trace = json.loads(gzip.decompress((folder / f"rank{rank}.pt.trace.json.gz").read_bytes()))
        names = {e.get("name", "") for e in trace["traceEvents"]}
        assert any(n.startswith(("aten::mm", "aten::addmm")) for n in names), f"rank {rank}'s trace has no matmul"
        summary = json.loads((folder / f"rank{rank}.summary.json").read_text())
        assert summary["rank"] == rank and summary["self_s"] > 0
    # the DDP all-reduces show as communication: a collective's time, not a formula's
    assert json.loads((folder / "rank1.summary.json").read_text())["comm_s"] > 0
    html = (folder / "summary.html").read_text()
    assert "rank 0" in html and "rank 1" in html
    assert result.result.steps == 30


TAKEN_PORT = """
import socket, sys, urllib.request
from pathlib import Path
from components.train.prometheus import Exporter
taken = socket.socket(); taken.bind(("127.0.0.1", 0)); taken.listen()
port = taken.getsockname()[1]
first = Exporter("run", 0, "node0", Path(sys.argv[1]) / "a")
assert first.serve(port, "127.0.0.1") is None  # taken: the rank goes on, unserved
first.step({"step": 7, "loss": 1.5})
free = socket.socket(); free.bind(("127.0.0.1", 0)); other = free.getsockname()[1]; free.close()
url = first.serve(other, "127.0.0.1")
print(urllib.request.urlopen(url, timeout=10).read().decode())
first.close()
"""


def test_a_metrics_port_that_is_taken_leaves_the_rank_training_and_recording(tmp_path):
    """A port another process holds never ends the training process: it records on, unserved;
    what it recorded is served once a port is free (here a second serve, in a fresh process)."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", TAKEN_PORT, str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    served = {s.name: s.value for f in text_string_to_metric_families(out.stdout) for s in f.samples}
    assert served["liftoff_train_step"] == 7 and served["liftoff_train_loss"] == 1.5
