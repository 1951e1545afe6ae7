"""Each stage's typed summary survives the trip through KFP's artifact metadata (a protobuf
Struct: numbers come back as floats, NaN cannot travel) and reads back as the same type."""

from __future__ import annotations

from types import SimpleNamespace

from google.protobuf import json_format, struct_pb2

from components import summaries as s


def through_kfp(summary):
    """Attach to an artifact, then carry its metadata as KFP does: a protobuf Struct, and back."""
    artifact = SimpleNamespace(metadata={"ref": "x"})
    s.attach(artifact, summary)
    struct = struct_pb2.Struct()
    struct.update(artifact.metadata)
    return s.find({"out": SimpleNamespace(metadata=json_format.MessageToDict(struct))})


def test_every_stages_summary_reads_back_as_itself_after_kfp():
    rows = [
        s.NodeRow("h-node0#0", True, 98.5, 2100.0, 3.1, 80.0, [], ["membw_gbps=2100 is 13.0 robust SDs below"]),
        s.NodeRow("h-node1#1", False, 10.0, None, None, 80.0, ["gemm_tflops_bf16=10 is 9.0 robust SDs below"]),
    ]
    stages = [
        s.TokenizeSummary("dataset/kjv@abc", 3189, 153, True),
        s.PreflightSummary(rows, "bf16", 1.25, 64.0, "/tmp/report.html", 4.2),
        s.TrainSummary(
            "model/tiny@def",
            "fresh",
            6.93,
            5.49,
            5517.0,
            0.53,
            ["h-node0", "h-node2"],
            {"h-node1": "gemm_tflops_bf16=10 is 9.0 robust SDs below"},
        ),  # fmt: skip
        s.ValidateSummary({"hashes": True, "finite": True}),
        s.EvaluateSummary(5.4, 221.4),
    ]
    for summary in stages:
        back = through_kfp(summary)
        assert type(back) is type(summary) and back.line() == summary.line(), summary
    table = through_kfp(stages[1]).table()
    assert table[0].split() == ["node", "verdict", "bf16", "TFLOP/s", "mem", "GB/s", "busbw", "GB/s", "memory", "GiB"]
    assert table[1].split()[-1] == "74.51"  # 80 GB (1e9 bytes, as recorded) in GiB
    assert table[2].split()[:3] == ["h-node1#1", "UNHEALTHY", "10"] and table[-2].startswith("h-node1#1: gemm_tflops")
    assert table[-1] == "h-node0#0: warning: membw_gbps=2100 is 13.0 robust SDs below"
    assert through_kfp(stages[1]).line() == (
        "measurements reused (4 min old), 1/2 nodes healthy, 1 warned (preflight.outliers=warn), "
        "plan 1.16 GiB per device of a 59.6 GiB budget"
    )
    said = through_kfp(stages[2]).line()
    assert said.endswith("peak 0.49 GiB, model/tiny@def; on h-node0, h-node2; left out h-node1: gemm_tflops_bf16=10 "
                         "is 9.0 robust SDs below")  # fmt: skip


def test_a_nan_loss_travels_as_none_and_reads_nan():
    back = through_kfp(s.TrainSummary("model/tiny@def", "fresh", float("nan"), 5.0, 1.0, 0.1))
    assert back.initial_loss is None and back.line().startswith("fresh; loss nan -> 5.00")


def test_outputs_without_a_summary_have_none():
    assert s.find({"a": SimpleNamespace(metadata={"ref": "x"}), "b": object()}) is None
    # another version's summary (a cached task): none, not an error at the end of a run
    other = {s.SUMMARY: {"kind": "TrainSummary", "model": "m", "a_field_of_another_version": 1}}
    assert s.find({"a": SimpleNamespace(metadata=other)}) is None
