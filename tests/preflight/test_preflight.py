"""Preflight on two local "nodes" through TorchX, and the gate."""

from __future__ import annotations

import pytest

from components.config import defaults
from components.preflight.stage import PreflightFailed, gate, report_markdown, run_preflight
from components.preflight.verdict import judge
from components.store import Ref
from tests.conftest import Trainer
from tests.faults import injected

EVERY_METRIC = [
    "gemm_tflops_fp32",
    "gemm_tflops_bf16",
    "membw_gbps",
    "allreduce_busbw_gbps_1mb",
    "allreduce_latency_us",
    "storage_read_mbps",
    "storage_roundtrip_mbps",
    "shm_gb",
    "free_disk_gb",
    "memlock_unlimited",
    "torch",
    "accelerator",
    "cuda",
    "driver",
    "host_step_s",
]


def preflight(trainer: Trainer, *overrides: str):
    cfg = trainer.config("cluster.nodes=2", *overrides)
    return cfg, run_preflight(
        trainer.dataset, cfg.model, cfg.train, cfg.cluster, cfg.preflight, trainer.store_cfg, trainer.store
    )


def test_two_node_preflight_measures_everything_and_passes(trainer):
    cfg, result = preflight(trainer)
    assert len(result.nodes) == 2
    for node in result.nodes:
        missing = [m for m in EVERY_METRIC if m not in node]
        assert not missing, missing
        assert node["gemm_tflops_fp32"] > 0 and node["storage_probe_ok"]
    gate(result)
    # the read probe: read_probe_mb in ranged reads of the largest train shard, not a download
    largest = max(
        s["splits"]["train"]["bytes"] for s in trainer.store.manifest(Ref.parse(trainer.dataset)).metadata["shards"]
    )
    assert largest < cfg.preflight.read_probe_mb << 20  # a small shard: the probe reads it round again
    assert {node["storage_read_mb"] for node in result.nodes} == {cfg.preflight.read_probe_mb}
    held = [p for p in trainer.tmp.rglob("*.arrow") if p.relative_to(trainer.tmp).parts[0] != "store"]
    assert held == []  # outside the store itself, no disk (a node's directory, a cache) holds a shard file
    report = report_markdown(result, cfg.preflight)
    assert report.count("| healthy |") == 2 and "## Plan" in report and "total per device" in report
    # the plan's step holds the slowest node's dispatch of it, on top of its GEMMs (a CPU: one thread does both)
    host = max(n["host_step_s"] for n in result.nodes)
    assert result.plan.host_s == host and result.plan.step_time_s >= result.plan.compute_s + host


def test_preflight_measures_every_process_as_training_runs_them(trainer):
    """One process per device (procs_per_node), each measuring its own; the node's first
    process also measures the store; a node with one bad device is excluded whole."""
    cfg, result = preflight(trainer, "cluster.nodes=1", "cluster.procs_per_node=2")
    assert [(n["rank"], n["local_rank"]) for n in result.nodes] == [(0, 0), (1, 1)]
    assert all(n["gemm_tflops_fp32"] > 0 and n["device"] == "cpu" for n in result.nodes)
    assert "storage_read_mbps" in result.nodes[0] and "storage_read_mbps" not in result.nodes[1]
    assert result.nodes[0]["host"] == result.nodes[1]["host"] and result.excluded_hosts == []
    result.verdicts[1].fail("a slow device")
    assert result.excluded_hosts == [result.nodes[1]["host"]]


@pytest.mark.chaos_slow  # 77 s, two preflights: in `make chaos`, out of `make test`'s 30 minutes
def test_throttled_node_is_unhealthy_and_the_gate_stops_the_run(trainer):
    with injected(throttle_node=1):  # outliers=quarantine: a cluster's default (locally they warn)
        cfg, result = preflight(trainer, "preflight.min_healthy_nodes=2", "preflight.outliers=quarantine")
    unhealthy = result.unhealthy
    assert list(unhealthy) == [f"{result.nodes[1]['host']}#1"]
    assert any("gemm_tflops" in r and "robust SDs below" in r for r in unhealthy[f"{result.nodes[1]['host']}#1"])
    with pytest.raises(PreflightFailed, match="1 healthy node\\(s\\), preflight.min_healthy_nodes=2"):
        gate(result)
    # the finding is a quarantine record in the store: the next preflight, the fault gone, keeps
    # off that node and measures the local fleet's spare in its place
    from components import fleet

    bad = result.nodes[1]["host"]
    (record,) = fleet.quarantined(trainer.store).values()
    assert (record.node, record.source) == (bad, "preflight") and "robust SDs below" in record.reason
    _, again = preflight(trainer, "preflight.min_healthy_nodes=2", "preflight.outliers=quarantine")
    hosts = [n["host"] for n in again.nodes]
    assert bad not in hosts and len(set(hosts)) == 2 and hosts[1].endswith("-node2"), hosts
    assert bad in again.excluded_hosts and again.problems == []


def test_a_slow_simulated_node_is_warned_of_quarantines_nothing_and_training_keeps_its_nodes(trainer):
    """Issue 43, acceptance 2: one local node throttled (a busy laptop, not a bad node). The
    verdict warns naming the metric, no node is unhealthy or quarantined, and the train job
    launched with the verdict runs on the configured nodes, the spare unused."""
    from components import fleet
    from components.launcher import build_app
    from components.train.stage import train_launch

    with injected(throttle_node=1):
        cfg, result = preflight(trainer)  # preflight.outliers=null: warn on the local scheduler
    slow = f"{result.nodes[1]['host']}#1"
    assert list(result.warnings) == [slow] and "robust SDs below" in result.warnings[slow][0], result.warnings
    assert result.unhealthy == {} and result.excluded_hosts == [] and result.problems == []
    assert fleet.quarantined(trainer.store) == {}
    _, _, launch = train_launch(
        trainer.dataset, cfg.model, cfg.train, cfg.cluster, trainer.store_cfg, result.excluded_hosts, cache_gb=1.0
    )
    app = build_app(launch.module, launch.spec, cfg.cluster, launch.name, {}, exclude=launch.exclude_nodes)
    assert app.roles[0].env[fleet.NODE_NAMES_ENV].split(",") == [n["host"] for n in result.nodes]
    report = trainer.store.fetch(trainer.store.resolve("preflight-report", result.ref.name)) / "report.md"
    assert f"- **{slow}**: " in report.read_text().split("## Warnings")[1]


def test_floors_above_what_the_nodes_measure_fail_the_gate_naming_the_floor(trainer):
    """Issue 22, point 5: absolute floors hold on a fleet that agrees with itself (every node
    on TCP measures alike, so no z-score flags one): real measurements on two local nodes,
    floors set above them, the gate names each floor and the key it came from."""
    cfg, result = preflight(trainer, "+preflight.floors={gemm_tflops_fp32:1000000,allreduce_busbw_gbps:100000}")
    assert result.healthy == []
    for node in result.nodes:
        reasons = result.unhealthy[f"{node['host']}#{node['rank']}"]
        assert any(
            r.startswith(f"gemm_tflops_fp32={node['gemm_tflops_fp32']:.4g} is below the floor 1e+06") for r in reasons
        )
        largest = max((k for k in node if k.startswith("allreduce_busbw_gbps_")), key=lambda k: float(k[21:-2]))
        assert any(
            f"allreduce_busbw_gbps={node[largest]:.4g} is below the floor 100000 (preflight.floors)" in r
            for r in reasons
        )
    with pytest.raises(PreflightFailed, match=r"0 healthy node\(s\).*gemm_tflops_fp32=.* is below the floor 1e\+06"):
        gate(result)


SIZES = {"allreduce_sizes_mb": [64.0, 1024.0]}


def test_a_gpu_types_floors_fail_a_fleet_on_tcp_sockets():
    """cluster.gpu_type's floors (preflight.device_floors). Two H200 nodes whose NCCL runs over
    the pod network (3 GB/s busbw, alike: no z-score fires) fail; at the fabric's 45 GB/s pass."""
    from components.preflight.verdict import floors_for

    cfg = defaults("preflight")
    floors, source = floors_for(cfg, "H200", nodes=2)
    assert floors["allreduce_busbw_gbps"] == pytest.approx(20.0) and "H200" in source
    tcp = [
        node(r, gemm_tflops_bf16=700.0, allreduce_busbw_gbps_64mb=2.0, allreduce_busbw_gbps_1024mb=3.1, **SIZES)
        for r in (0, 1)
    ]
    verdicts = judge(tcp, cfg, floors, source)
    assert not any(v.healthy for v in verdicts)
    assert all(r == f"allreduce_busbw_gbps=3.1 is below the floor 20 ({source})" for v in verdicts for r in v.reasons)
    ib = [
        node(r, gemm_tflops_bf16=700.0, allreduce_busbw_gbps_64mb=9.0, allreduce_busbw_gbps_1024mb=45.0, **SIZES)
        for r in (0, 1)
    ]
    assert all(v.healthy for v in judge(ib, cfg, floors, source))
    assert floors_for(cfg, None, nodes=2)[0] == {}  # a CPU rehearsal has no device table entry
    assert floors_for(defaults("preflight", device_floors=False), "H200", nodes=2)[0] == {}


def test_by_default_every_node_must_pass_and_a_node_counts_once_whatever_its_devices():
    """preflight.min_healthy_nodes null (the default): train's gang asks for every node, so one
    excluded node fails the gate; a node is one node however many devices it measured."""
    from components.preflight.plan import plan
    from components.preflight.stage import PreflightResult, gate_problems

    step_plan = plan(defaults("model"), defaults("train"), 4, 64, 1024, tflops=50.0)
    nodes = [node(0), node(1), {**node(2), "host": "h0"}, {**node(3, membw_gbps=10.0), "host": "h1"}]
    result = PreflightResult(nodes, judge(nodes, defaults("preflight")), step_plan, 80.0, 1.0)
    assert result.excluded_hosts == ["h1"]
    problems = gate_problems(result, defaults("preflight"))
    assert problems and problems[0].startswith("1 healthy node(s), preflight.min_healthy_nodes=None (every node: 2)")
    assert gate_problems(result, defaults("preflight", min_healthy_nodes=1)) == []


def test_plan_that_does_not_fit_fails_the_gate(trainer):
    cfg, result = preflight(trainer, "preflight.device_memory_gb=0.001")
    with pytest.raises(
        PreflightFailed,
        match=r"the plan does not fit by .* GiB per device \(preflight.memory_headroom=0.1\) > 0.00 GiB",
    ):
        gate(result)


def node(rank, **kw):
    base = {
        "rank": rank,
        "host": f"h{rank}",
        "gemm_tflops_bf16": 100.0,
        "membw_gbps": 3000.0,
        "torch": "2.13.0",
        "accelerator": "H200",
        "driver": "570",
        "cuda": "12.8",
    }
    return {**base, **kw}


def test_mixed_versions_name_the_odd_node():
    verdicts = judge([node(0), node(1), node(2, torch="2.12.0")], defaults("preflight"))
    assert [v.healthy for v in verdicts] == [True, True, False]
    assert "torch=2.12.0 differs from the fleet" in verdicts[2].reasons[0]


def test_floors_apply_to_every_node():
    verdicts = judge([node(0), node(1)], defaults("preflight", floors={"membw_gbps": 4000.0}))
    assert not any(v.healthy for v in verdicts) and "below the floor 4000" in verdicts[0].reasons[0]


def test_quarantine_labels_and_taints(monkeypatch):
    from types import SimpleNamespace

    from components.preflight.quarantine import LABEL, TAINT_KEY, quarantine_nodes

    patched = {}

    class CoreV1:
        def read_node(self, name):
            return SimpleNamespace(spec=SimpleNamespace(taints=None))

        def patch_node(self, name, body):
            patched[name] = body

    quarantine_nodes(["gpu-7"], {"gpu-7": ["slow"]}, api=CoreV1())
    assert patched["gpu-7"]["metadata"]["labels"][LABEL] == "unhealthy"
    assert patched["gpu-7"]["spec"]["taints"][0]["key"] == TAINT_KEY


@pytest.mark.parametrize("device_gb,passed", [(80.0, True), (0.001, False)])
def test_the_report_is_published_as_html_whether_or_not_the_gate_passes(tmp_path, device_gb, passed):
    from html.parser import HTMLParser

    from components.preflight.plan import plan
    from components.preflight.stage import PreflightResult, publish_report
    from components.store import open_store

    store = open_store(defaults("store", root=str(tmp_path / "store"), cache_dir=str(tmp_path / "cache")))
    (tmp_path / "nodes").mkdir()
    (tmp_path / "nodes" / "nodes.json").write_text("[]")
    measured = store.publish("preflight", "local_cwd-2n", "20261201T220000-abcd1234", tmp_path / "nodes")
    cfg = defaults("preflight", min_healthy_nodes=1)  # one slow node excluded, the other trains
    nodes = [node(0), node(1, membw_gbps=10.0)]
    step_plan = plan(defaults("model"), defaults("train"), 2, 64, 1024, tflops=50.0)
    result = PreflightResult(nodes, judge(nodes, cfg), step_plan, device_gb, 1.0, measured.ref)
    path = publish_report(result, cfg, store)

    stored = store.resolve("preflight-report", "local_cwd-2n", "20261201T220000-abcd1234")
    assert stored.parents == [str(measured.ref)] and stored.metadata["passed"] is passed
    assert path.name == "report.html" and path.read_text() == (store.fetch(stored) / "report.html").read_text()
    assert (store.fetch(stored) / "report.md").read_text().startswith("# Preflight")

    class Cells(HTMLParser):
        tags, text = [], ""

        def handle_starttag(self, tag, attrs):
            self.tags.append(tag)

        def handle_data(self, data):
            self.text += data

    page = Cells()
    page.feed(path.read_text())
    assert {"style", "h1", "table", "th", "td", "pre"} <= set(page.tags)
    assert (
        "h0#0" in page.text
        and "h1#1" in page.text
        and ("passed" if passed else "the plan does not fit by") in page.text
    )


def test_a_device_one_ulp_off_in_sdpa_is_unhealthy_and_training_keeps_off_its_node(trainer):
    """Issue 24, acceptance 1: node 1's SDPA in the numerics battery returns one element one
    ulp off (silent data corruption); its verdict names the operator, the other node passes,
    and the train job launched with the verdict runs on node 0 and the local fleet's spare."""
    from components import fleet
    from components.launcher import build_app
    from components.train.stage import train_launch

    with injected(perturb_node=1, perturb_op="sdpa"):
        cfg, result = preflight(trainer, "preflight.min_healthy_nodes=1", "preflight.numerics_s=0.5")
    bad, good = result.nodes[1]["host"], result.nodes[0]["host"]
    assert list(result.unhealthy) == [f"{bad}#1"], result.unhealthy
    (reason,) = result.unhealthy[f"{bad}#1"]
    assert reason == "numerics: sdpa in float32 differs bitwise from this device type's reference run"
    assert result.problems == [] and result.excluded_hosts == [bad]
    assert result.nodes[0]["numerics"]["rounds"] >= 1 and result.nodes[0]["numerics"]["allreduce_exact"]
    _, _, launch = train_launch(
        trainer.dataset, cfg.model, cfg.train, cfg.cluster, trainer.store_cfg, result.excluded_hosts, cache_gb=1.0
    )
    app = build_app(launch.module, launch.spec, cfg.cluster, launch.name, {}, exclude=launch.exclude_nodes)
    names = app.roles[0].env[fleet.NODE_NAMES_ENV].split(",")
    assert bad not in names and names[0] == good and len(names) == 2


def test_a_device_one_ulp_off_in_gemm_is_named_by_the_numerics_battery(monkeypatch):
    """The GEMM is in the battery: node 1's GEMM one ulp off in one element (the fault the SDPA
    test injects, here on the GEMM) is named, against the driver's reference run and, without
    one, against the majority of its peers; the healthy nodes are not."""
    import torch

    from components.preflight import bench, numerics
    from tests.faults import install_preflight

    cpu = torch.device("cpu")
    kind = bench.accelerator(cpu)

    def node(ops: dict) -> dict:
        return {"accelerator": kind, "numerics": {"dtype": "float32", "rounds": 1, "ops": ops, "allreduce_exact": True}}

    healthy = numerics.battery(cpu, "float32", 1)
    assert "gemm" in healthy, f"the battery runs no GEMM: {sorted(healthy)}"
    reference = numerics.reference([node(healthy)], kind)  # the driver's own run: no fault there
    monkeypatch.setitem(numerics.RUN, "gemm", numerics.RUN["gemm"])  # restored after the test
    with injected(perturb_node=1, perturb_op="gemm"):
        install_preflight(1)
    perturbed = numerics.battery(cpu, "float32", 1)
    nodes = [node(healthy), node(perturbed)]
    reason = "numerics: gemm in float32 differs bitwise from this device type's reference run"
    assert numerics.problems(nodes, reference) == {1: [reason]}
    peers = [node(healthy), node(perturbed), node(healthy)]
    assert numerics.problems(peers, None) == {1: ["numerics: gemm in float32 differs bitwise from the other "
                                                   f"{kind} devices"]}  # fmt: skip


def test_the_fleet_key_changes_with_what_is_measured_and_not_with_how_it_is_judged():
    """Issue 43, point 1: measurements are reused under `fleet_name` only. Anything that changes
    what a node measures (the node set, held-out nodes, processes, precision, the benchmark sizes,
    the dataset, NCCL's environment) names another fleet; how the numbers are judged does not."""
    from omegaconf import OmegaConf

    from components.config import compose
    from components.preflight.stage import fleet_name

    def name(*overrides: str, held_out=(), dataset: str = "dataset/kjv@a") -> str:
        cfg = OmegaConf.to_object(compose(list(overrides)))
        return fleet_name(dataset, cfg.model, cfg.train, cfg.cluster, cfg.preflight, held_out)

    base = name()
    measured = [
        name("cluster.nodes=3"),
        name("cluster.procs_per_node=2"),
        name(held_out={"vm-node1": "quarantined"}),
        name("train.precision=fp32"),  # another compute dtype (fp8 computes in bf16, as the default)
        name("preflight.gemm_size=256"),
        name("preflight.numerics_s=0"),
        name(dataset="dataset/kjv@b"),
        name("+cluster.env={NCCL_IB_HCA:mlx5}"),
    ]
    assert base not in measured and len(set(measured)) == len(measured), measured
    judged = ["preflight.zscore_threshold=3", "+preflight.floors={membw_gbps:1}", "preflight.min_healthy_nodes=1",
              "preflight.max_age_min=5", "preflight.outliers=quarantine", "train.lr=1e-4"]  # fmt: skip
    assert {name(o) for o in judged} == {base}


def test_only_young_whole_measurements_are_reused(tmp_path):
    import json

    from components.preflight.stage import reusable_measurements
    from components.store import open_store

    store = open_store(defaults("store", root=str(tmp_path / "store"), cache_dir=str(tmp_path / "cache")))
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "nodes.json").write_text(json.dumps([node(0), node(1)]))
    published = store.publish("preflight", "local_cwd-2n-abc", "20261207T000000-aaaa", tmp_path / "m")
    found = reusable_measurements(store, "local_cwd-2n-abc", 60.0, processes=2)
    assert found is not None and found[0].ref == published.ref and [n["rank"] for n in found[1]] == [0, 1]
    assert reusable_measurements(store, "local_cwd-2n-abc", 0.0, processes=2) is None  # max_age_min=0
    assert reusable_measurements(store, "local_cwd-2n-abc", 1e-9, processes=2) is None  # older than allowed
    assert reusable_measurements(store, "local_cwd-2n-abc", 60.0, processes=3) is None  # not one per process
    assert reusable_measurements(store, "local_cwd-2n-other", 60.0, processes=2) is None  # another fleet


def test_on_a_cpu_the_fp8_gemm_preflight_times_is_the_one_training_runs():
    """Issue 40, point 5: emulated fp8 is measured as what it is. The GEMM preflight times for fp8
    on a CPU dispatches the ops a training Float8Linear's forward does (built from the trainer's
    own config: quantize both operands, multiply in fp32), never the reference `_scaled_mm`
    that training there never calls (2-3x faster: it planned the tiny step at half its time)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from components.precision import recipe
    from components.precision.fp8 import module_filter

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.add(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    cpu, fp8 = torch.device("cpu"), recipe("fp8")
    train = defaults("train", precision="fp8")
    timed = fp8.gemm(32, cpu)
    with Ops() as gemm:
        timed()
    from torchao.float8 import convert_to_float8_training

    model = torch.nn.Sequential(torch.nn.Linear(32, 32, bias=False))
    convert_to_float8_training(model, config=fp8.float8_config(train, cpu), module_filter_fn=module_filter(None))
    x = torch.randn(32, 32, dtype=torch.bfloat16)
    with Ops() as trained, torch.no_grad():
        model(x)
    assert "aten._scaled_mm" not in gemm.seen and "aten._scaled_mm" not in trained.seen, (gemm.seen, trained.seen)
    assert gemm.seen == trained.seen and "aten.mm" in gemm.seen, gemm.seen ^ trained.seen


def test_the_host_step_preflight_times_dispatches_the_ops_of_the_runs_step_and_the_plan_counts_it():
    """Issue 40, acceptance 5: on a CPU one thread dispatches every op and runs it, so a step
    small enough that its GEMMs take nothing still takes the host's dispatch of its ops (the
    tiny run's CI step was 2.6x a plan of GEMMs alone). Preflight times that dispatch on a proxy
    of the run's model (`bench.host_step_s`): (1) the proxy's step dispatches the very ops, op
    for op, of a step of the run's own model (its fp8 recipe, checkpointing, micro-batches,
    fused AdamW); (2) the plan with the measured dispatch times a host-bound step of the real
    model (one 16-token sequence a micro-batch) within 2x of it, measured here; GEMMs alone plan
    it at a fraction."""
    import collections
    import statistics
    import time

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from components.models import build_model, token_loss
    from components.optimizer import build_optimizer
    from components.parallel.checkpointing import apply_activation_checkpointing
    from components.precision import recipe
    from components.preflight import bench
    from components.preflight.plan import plan

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen: collections.Counter = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    cpu = torch.device("cpu")
    model_cfg = defaults("model", name="t", vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                         ffn_hidden_size=128, max_seq_len=64, rope_theta=10000.0, tie_embeddings=False,
                         family="llama", num_experts=0, experts_per_token=0, router_aux_loss_coef=0.0)  # fmt: skip
    train = defaults("train", precision="fp8", activation_checkpointing="full", micro_batch_size=1,
                     grad_accum_steps=2, loss_chunk_tokens=0)  # fmt: skip
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as one training process of the tiny run
    try:
        net = build_model(model_cfg, 512, 0)
        precision = recipe("fp8")
        precision.apply(net, train, cpu)
        apply_activation_checkpointing(net, train.activation_checkpointing, train.ac_every_n_blocks)
        optimizer = build_optimizer(net, train)
        batch = torch.randint(0, 512, (1, bench.PROXY_TOKENS + 1))

        def step():
            for _ in range(train.grad_accum_steps):
                with precision.autocast(cpu, False):
                    logits = net(input_ids=batch[:, :-1]).logits
                token_loss(logits, batch[:, 1:], 0).backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), train.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        timed_step = bench.host_step(model_cfg, train, cpu)
        with Ops() as real:
            for _ in range(3):
                step()
        with Ops() as proxy:
            for _ in range(3):
                timed_step()
        assert proxy.seen == real.seen, (proxy.seen - real.seen, real.seen - proxy.seen)
        assert proxy.seen["aten.mm"] and proxy.seen["aten.sum"], proxy.seen  # Float8Linear's and the recompute's

        times = []
        for _ in range(7):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        measured = statistics.median(times)
        tflops = bench.gemm_tflops(precision, 64, 3, cpu)
        host = bench.host_step_s(model_cfg, train, cpu, 5)
        planned = [
            plan(model_cfg, train, 1, bench.PROXY_TOKENS, tflops=tflops, cuda=False, host_s=h) for h in (host, None)
        ]
    finally:
        torch.set_num_threads(threads)
    with_host, gemms_alone = (p.step_time_s / measured for p in planned)
    assert 0.5 <= with_host <= 2.0 and gemms_alone < 0.5, (with_host, gemms_alone, measured)
