"""A composed config's plan: the device it is judged and timed against (memory, peak and bus
bandwidth, each with where it comes from), and the fewest changes that make it fit (`suggest`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from components.config import ActivationCheckpointing, Parallelism
from components.config.rules import train_rules
from components.parallel import ParallelDims
from components.preflight.plan import Plan, fits, host_memory_gb, plan, reserved_gb, verdict
from components.summaries import gib


@dataclass
class PlanDevice:
    """What a config's plan is judged and timed against, and where each figure comes from."""

    name: str
    memory_gb: float
    memory_source: str
    peak_tflops: float | None
    peak_source: str
    efficiency: float  # the fraction of the peak the linear layers are timed at (components/devices.py)
    efficiency_source: str
    attention_efficiency: float  # ... and attention (bf16 flash attention whatever the recipe)
    busbw_gbps: float | None
    busbw_source: str


def plan_device(cfg) -> PlanDevice:
    """Device memory: `preflight.device_memory_gb`, else the device table by `cluster.gpu_type`,
    else this host's RAM. Peak: `train.peak_tflops`, else the table's dense bf16 peak; compute
    runs at the table's efficiency of it for the recipe (`efficiency_for`: precision, fp8
    scaling, compiled or eager; an assumed 0.40 for bf16 on a device not in it). Bus
    bandwidth: the table's assumption for one node or for the network across nodes."""
    from components.devices import Device, attention_efficiency_for, busbw_gbps, device, efficiency_for, recipe_key

    gpu = cfg.cluster.gpu_type
    spec = device(gpu) if gpu else None
    table = f"cluster.gpu_type={gpu} (components/devices.py)"
    if cfg.preflight.device_memory_gb:
        memory, memory_source = cfg.preflight.device_memory_gb, "preflight.device_memory_gb"
    elif spec:
        memory, memory_source = spec.memory_gb, table
    else:
        memory, memory_source = host_memory_gb(), "this host's RAM (cluster.gpu_type is null)"
    peak, peak_source = published_peak(cfg.train, cfg.cluster)
    compiled = cfg.train.compile if cfg.train.compile is not None else bool(gpu)  # None: compiled on GPUs
    efficiency = efficiency_for(spec.efficiency if spec else Device.efficiency, cfg.train, compiled)
    attention = attention_efficiency_for(spec, compiled)
    efficiency_source = (
        f"{recipe_key(cfg.train)}{'' if compiled else ', eager'}: "
        f"{spec.efficiency_source if spec else Device.efficiency_source}"
    )
    nodes, world = cfg.cluster.nodes, cfg.cluster.nodes * cfg.cluster.procs_per_node
    if world == 1:
        busbw, busbw_source = None, "one device: no communication"
    elif spec:
        link = "NVLink within one node" if nodes == 1 else "the network across nodes"
        busbw, busbw_source = busbw_gbps(spec, nodes), f"assumed, {link} ({gpu}, components/devices.py)"
    else:
        busbw, busbw_source = None, "unknown without cluster.gpu_type: communication left out"
    return PlanDevice(
        gpu or "this host", memory, memory_source, peak, peak_source, efficiency, efficiency_source, attention, busbw,
        busbw_source,
    )  # fmt: skip


def published_peak(train, cluster) -> tuple[float | None, str]:
    """(the dense peak TFLOP/s MFU is reported against, where it comes from): `train.peak_tflops`,
    else the device table's bf16 peak for `cluster.gpu_type`; none for anything else (a CPU): a
    measured throughput is no peak."""
    from components.devices import device

    spec = device(cluster.gpu_type) if cluster.gpu_type else None
    if train.peak_tflops:
        return train.peak_tflops, "train.peak_tflops"
    if spec:
        return spec.peak_tflops["bf16"], f"dense bf16, cluster.gpu_type={cluster.gpu_type} (components/devices.py)"
    return None, "unknown: set cluster.gpu_type or train.peak_tflops for step time and MFU"


def plan_for(cfg) -> tuple[Plan, PlanDevice]:
    """The plan for a composed config, without any hardware, and the device it is judged against."""
    vocab = cfg.model.vocab_size or cfg.tokenizer.vocab_size
    world = cfg.cluster.nodes * cfg.cluster.procs_per_node
    d = plan_device(cfg)
    p = plan(
        cfg.model,
        cfg.train,
        world,
        cfg.data.seq_len,
        vocab,
        tflops=d.peak_tflops * d.efficiency if d.peak_tflops else None,
        attention_tflops=d.peak_tflops * d.attention_efficiency if d.peak_tflops else None,
        peak_tflops=d.peak_tflops,
        busbw_gbps=shard_group_busbw(cfg, d),
        replicate_busbw_gbps=d.busbw_gbps,
        tp_busbw_gbps=tp_group_busbw(cfg.train, cfg.cluster),
        cuda=bool(cfg.cluster.gpu_type),
    )
    return p, d


def tp_group_busbw(train, cluster) -> float | None:
    """A tp group's bus bandwidth: NVLink when its consecutive ranks are on one node."""
    from components.devices import busbw_gbps, device

    if train.tp == 1 or not cluster.gpu_type:
        return None
    return busbw_gbps(device(cluster.gpu_type), 1 if cluster.procs_per_node % train.tp == 0 else 2)


def shard_group_busbw(cfg, d: PlanDevice) -> float | None:
    """The bus bandwidth FSDP's collectives see: the world's, or for HSDP a shard group's
    (consecutive ranks: within one node when it spans procs_per_node ranks or fewer, its tp
    ranks included; under pipeline parallelism, a stage's)."""
    from components.devices import busbw_gbps, device

    t, c = cfg.train, cfg.cluster
    spec = device(cfg.cluster.gpu_type) if cfg.cluster.gpu_type else None
    if t.parallelism != Parallelism.fsdp or (t.dp_replicate == 1 and t.pp == 1) or spec is None or d.busbw_gbps is None:
        return d.busbw_gbps
    dims = ParallelDims.of(t, c.nodes * c.procs_per_node)
    span = dims.dp_shard * dims.tp  # a shard group's dp ranks x their tp ranks
    return busbw_gbps(spec, -(-span // c.procs_per_node))


AC, PARALLELISM, MICRO_BATCH = "train.activation_checkpointing", "train.parallelism", "train.micro_batch_size"
FSDP_SYNC = "train.fsdp_sync_every_microbatch"
PROCS, NODES = "cluster.procs_per_node", "cluster.nodes"


def with_changes(cfg, changes: dict):
    """The config with `changes` ({"train.parallelism": Parallelism.fsdp, ...}) applied."""
    groups = {}
    for key, value in changes.items():
        group, name = key.split(".")
        groups.setdefault(group, {})[name] = value
    return replace(cfg, **{g: replace(getattr(cfg, g), **values) for g, values in groups.items()})


def _fits_with(cfg, changes: dict) -> bool:
    """Whether the config with `changes` composes (a halved micro batch may not fill the
    pipeline's stages) and fits."""
    changed = with_changes(cfg, changes)
    if train_rules(changed.train, changed.cluster, changed.model):
        return False
    p, d = plan_for(changed)
    return fits(p, d.memory_gb, cfg.preflight.memory_headroom)


def _candidates(cfg):
    """Changes in order of cost, each adding to the last: FSDP's reduce-scatter after every
    micro-batch (sharded gradients accumulate), activation checkpointing selective then full, FSDP instead of
    DDP, the micro batch halved down to 1, every GPU of a node used, then 2x, 4x, 8x and 16x
    the nodes."""
    t, c, changes = cfg.train, cfg.cluster, {}
    if not t.fsdp_sync_every_microbatch:
        changes[FSDP_SYNC] = True
        yield dict(changes)
    if not t.activation_checkpointing:  # selective first: it recomputes less
        changes[AC] = ActivationCheckpointing.selective
        yield dict(changes)
    if t.activation_checkpointing != ActivationCheckpointing.full:
        changes[AC] = ActivationCheckpointing.full
        yield dict(changes)
    if t.parallelism != Parallelism.fsdp:
        changes[PARALLELISM] = Parallelism.fsdp
        yield dict(changes)
    b = t.micro_batch_size
    while b > 1:
        b //= 2
        changes[MICRO_BATCH] = b
        yield dict(changes)
    if c.gpu > c.procs_per_node:
        changes[PROCS] = c.gpu
        yield dict(changes)
    for factor in (2, 4, 8, 16):
        changes[NODES] = c.nodes * factor
        yield dict(changes)


def suggest(cfg) -> dict | None:
    """The first candidate that fits, less the changes it does not need; None when none fits."""
    found = next((changes for changes in _candidates(cfg) if _fits_with(cfg, changes)), None)
    if found is None:
        return None
    for key in (FSDP_SYNC, AC, PARALLELISM, MICRO_BATCH, PROCS):
        fewer = {k: v for k, v in found.items() if k != key}
        if key in found and _fits_with(cfg, fewer):
            found = fewer
    return found


def sync_skip(cfg) -> tuple[Plan, PlanDevice] | None:
    """The plan with FSDP's gradient sync skipped between micro-batches, when this config
    syncs every one and skipping it still fits (less traffic, for unsharded gradients)."""
    t = cfg.train
    if t.parallelism != Parallelism.fsdp or t.grad_accum_steps == 1 or not t.fsdp_sync_every_microbatch or t.pp > 1:
        return None  # (under pipeline parallelism the schedule decides: it syncs the last only)
    p, d = plan_for(with_changes(cfg, {FSDP_SYNC: False}))
    return (p, d) if fits(p, d.memory_gb, cfg.preflight.memory_headroom) else None


def as_overrides(changes: dict) -> list[str]:
    def text(v) -> str:
        return str(v).lower() if isinstance(v, bool) else str(getattr(v, "value", v))

    return [f"{k}={text(v)}" for k, v in changes.items()]


def plan_refusal(cfg) -> str | None:
    """One line when the plan of a typed config does not fit its device: the plan's figures, the
    nearest layout that fits (as overrides) or that nothing tried fits, and the command that
    explains it; None when it fits. Checked by `liftoff run` before tokenize and by the cluster
    commands before anything is compiled or sent."""
    p, device = plan_for(cfg)
    headroom = cfg.preflight.memory_headroom
    if fits(p, device.memory_gb, headroom):
        return None
    changes = suggest(cfg)
    nearest = (
        f"nearest layout that fits: {' '.join(as_overrides(changes))}"
        if changes
        else f"no layout up to {cfg.cluster.nodes * 16} nodes fits: a smaller model or a shorter data.seq_len"
    )
    return (
        f"the plan {verdict(p, device.memory_gb, headroom)}: {gib(reserved_gb(p, headroom)):.1f} GiB per device "
        f"(preflight.memory_headroom={headroom}) > {gib(device.memory_gb):.1f} GiB ({device.name}); {nearest}; "
        "`liftoff plan` with these overrides says more"
    )
