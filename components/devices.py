"""The accelerators liftoff runs on: published dense peak TFLOP/s, memory per GPU and the bus
bandwidth the planner assumes, looked up by device name (`torch.cuda.get_device_name`) or by
`cluster.gpu_type` ("H200").

Peaks: dense (no 2:4 sparsity) tensor-core figures from the vendors' data sheets. MFU is
reported against the bf16 peak, as torchtitan and PaLM do, whatever the training precision.

Memory: the data sheet's GB per GPU (B200: DGX B200's 1,440 GB over 8), read as 1e9 bytes,
a little under what torch reports as total memory (H100: 85.0e9), so the planner errs low.

Bus bandwidth (GB/s per GPU, nccl-tests' all-reduce busbw) is an assumption, not a
measurement: the ring is as fast as its slowest hop, so within one node it is the NVLink /
Infinity Fabric figure (~90% of one direction's link bandwidth: H100/H200 NVLink 4 450 GB/s ->
400, B200 NVLink 5 900 -> 800, A100 NVLink 3 300 -> 230, MI300X 7 x 64 GB/s -> 300, PCIe-only
cards 20-40) and across nodes the network's per GPU (one 400 Gb/s NIC per GPU, as DGX/HGX
H100, H200, B200 and MI300X nodes have: 50 GB/s; A100 nodes 200 Gb/s: 25; L40S/PCIe
servers assumed at 100-200 Gb/s). Preflight measures the real figure (`allreduce_busbw_gbps_*`).

Efficiency: the fraction of the dense bf16 peak a step's FLOPs run at (its recomputation
counted), in two parts the planner times apart (components/preflight/plan.py): the linear layers'
matmuls, at the precision recipe's rate (`efficiency_for`), and attention's scores and values,
which flash attention runs in bf16 whatever the recipe (`attention_efficiency_for`; counted as
PaLM does, 12·L·h·s a token, the causal half it skips included). Communication is timed apart and
only what compute cannot hide is added. H100 / H200 / GH200 (one Hopper die, the same peak):
FITTED on three of torchtitan's rows (benchmarks/published_h100.json), where communication is
hidden, so that the planned step is the published one: Table 1's 8B compiled bf16 and fp8
tensorwise rows (seq 8192, attention 20% of the FLOPs) and Table 2's fp8 row at seq 32k (54%)
solve for linear bf16 0.418, linear fp8 tensorwise (compiled, fp8 all-gather) 0.572 and attention
0.454. fp8 rowwise's linear rate is bf16's x 1.146, what makes a whole step 1.115x bf16 compiled's
at Table 1's attention share: torchtitan's own side-by-side on 8 H100s (pytorch/torchtitan@7a04053,
its message: 5,760 tokens/s bf16 compiled, 6,424 rowwise fp8, 7,186 tensorwise). A step run
eager runs at Table 1's bf16 eager / compiled ratio, 0.866 (an assumption for fp8: torchtitan
publishes fp8 compiled only). A100: 0.52 for bf16, Narayanan et al. SC'21 (Megatron on 3,072
A100s: 163 TFLOP/s per GPU for a 1T model, recomputation counted), for both parts. The others
have no figure in these sources: 0.40, labelled an assumption; on them and on the A100 the
recipes keep the H100's ratios to bf16 compiled.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Device:
    key: str  # the substring a device name contains
    peak_tflops: dict[str, float]  # dtype -> dense peak
    memory_gb: float
    intra_node_busbw_gbps: float  # assumed all-reduce bus bandwidth per GPU within a node
    inter_node_busbw_gbps: float  # ... and across nodes (the network per GPU)
    efficiency: float = 0.40  # the fraction of the bf16 peak compiled bf16 linear layers run at (see above)
    efficiency_source: str = "assumed: no published pretraining MFU for this device in the table's sources"
    attention: float | None = None  # ... and attention (flash, bf16); None: `efficiency`


TITAN_H100 = "fitted on torchtitan's Tables 1-2, Llama 3.1 8B on 8 H100s (benchmarks/published_h100.json)"
MEGATRON_A100 = "Megatron on 3,072 A100s (Narayanan et al., SC'21: 52% of peak, a 1T model)"

# each recipe's linear-layer rate against bf16 compiled's on the same device: FITTED on
# torchtitan's Tables 1-2 (tensorwise 0.572 / 0.418), rowwise from pytorch/torchtitan@7a04053
# (a whole step 6,424 against 5,760 bf16 compiled tokens/s, at 20% attention FLOPs)
RECIPE_RATIO = {
    "fp32": 0.5,
    "bf16": 1.0,
    "fp8_tensorwise": 1.370,
    "fp8_rowwise": 1.146,
    "fp8_rowwise_with_gw_hp": 1.146,
}
EAGER_RATIO = 0.866  # eager / compiled, bf16 (Table 1: 5,762 / 6,667 tokens/s); fp32 runs TF32 at about half bf16


# First match wins, so the more specific names come first ("GH200" before "H200").
DEVICES: list[Device] = [
    Device("H100 PCIe", {"bf16": 756.0, "fp8": 1513.0}, 80.0, 40.0, 25.0),
    Device("H100", {"bf16": 989.4, "fp8": 1978.9}, 80.0, 400.0, 50.0, 0.418, TITAN_H100, 0.454),  # SXM
    Device("GH200", {"bf16": 989.4, "fp8": 1978.9}, 96.0, 400.0, 50.0, 0.418, TITAN_H100, 0.454),
    Device("H200", {"bf16": 989.4, "fp8": 1978.9}, 141.0, 400.0, 50.0, 0.418, TITAN_H100, 0.454),
    Device("B200", {"bf16": 2250.0, "fp8": 4500.0}, 180.0, 800.0, 50.0),
    Device("A100-SXM4-40GB", {"bf16": 312.0}, 40.0, 230.0, 25.0, 0.52, MEGATRON_A100),
    Device("A100-PCIE-40GB", {"bf16": 312.0}, 40.0, 25.0, 25.0),
    Device("A100", {"bf16": 312.0}, 80.0, 230.0, 25.0, 0.52, MEGATRON_A100),
    Device("L40S", {"bf16": 362.1, "fp8": 733.0}, 48.0, 20.0, 12.5),
    Device("MI300X", {"bf16": 1307.4, "fp8": 2614.9}, 192.0, 300.0, 50.0),
]


def device(name: str) -> Device | None:
    """The table's entry for a device name ("NVIDIA H200", or a `cluster.gpu_type` like "H200")."""
    for d in DEVICES:
        if d.key.lower() in name.lower():
            return d
    return None


def recipe_key(train) -> str:
    """The efficiency table's key of a train config's precision recipe ("bf16", "fp8_rowwise")."""
    precision = str(getattr(train.precision, "value", train.precision))
    if precision != "fp8":
        return precision
    return f"fp8_{getattr(train.fp8_recipe, 'value', train.fp8_recipe)}"


def efficiency_for(base: float, train, compiled: bool) -> float:
    """The fraction of the bf16 peak the linear layers of this recipe run at on a device whose
    compiled bf16 figure is `base`: the recipe's ratio (RECIPE_RATIO), times EAGER_RATIO uncompiled."""
    return base * RECIPE_RATIO[recipe_key(train)] * (1.0 if compiled else EAGER_RATIO)


def attention_efficiency_for(d: Device | None, compiled: bool) -> float:
    """The fraction of the bf16 peak attention runs at on `d` (bf16 whatever the recipe); a
    device not in the table runs it at the assumed `Device.efficiency`."""
    base = (d.attention or d.efficiency) if d else Device.efficiency
    return base * (1.0 if compiled else EAGER_RATIO)


def peak_tflops(device_name: str, dtype: str = "bf16") -> float | None:
    """The dense peak for `dtype` of the device whose name contains a known model, else None."""
    d = device(device_name)
    return d.peak_tflops.get(dtype) if d else None


def busbw_gbps(d: Device, nodes: int) -> float:
    """The assumed all-reduce bus bandwidth per GPU of a job over `nodes` nodes."""
    return d.intra_node_busbw_gbps if nodes == 1 else d.inter_node_busbw_gbps


# Preflight's absolute floors are this fraction of the table's figures: a healthy H100/H200
# reaches 60-75% of its dense bf16 peak in a large GEMM and nccl-tests' busbw near the
# assumption, so 40% leaves room for a benchmark's noise and still fails a throttled device
# or NCCL on TCP sockets (a 25-100 Gb/s pod network: 3-12 GB/s against 50 assumed).
FLOOR_FRACTION = 0.4


def preflight_floors(d: Device, nodes: int) -> dict[str, float]:
    """The absolute minimum each preflight metric must reach on this device, whatever the rest
    of the fleet measures (a fleet all on TCP agrees with itself)."""
    floors = {f"gemm_tflops_{dtype}": FLOOR_FRACTION * peak for dtype, peak in d.peak_tflops.items()}
    floors["allreduce_busbw_gbps"] = FLOOR_FRACTION * busbw_gbps(d, nodes)
    return floors
