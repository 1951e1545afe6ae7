"""The planner: memory per device, FLOPs, step time, tokens/s and MFU for a config, no hardware needed.

Formulas (N = parameters, W = data-parallel world size, s = seq len, b = micro batch,
h = hidden, L = layers, a = heads):

- Parameters N: embeddings V·h, per block q,o: h·h, k,v: h·(kv_heads·h/a), MLP 3·h·ffn,
  two RMSNorms 2·h; final norm h; output head V·h unless tied.
- Weights: this trainer keeps fp32 master weights as the parameters (4 B/param). Compute
  copies come from the precision recipe (`components/precision`): under DDP, bf16 autocast
  caches a bf16 copy of every Linear weight for the step (2 B/param), while fp8 casts of the
  Float8Linear weights are transient; under FSDP the unsharded parameters of the root (kept
  through the step) and of two blocks (computing + prefetched) exist at the compute dtype
  (fp8 all-gather: 1 B for the Float8Linear weights).
- Gradients: fp32, 4 B/param. AdamW: two fp32 moments, 8 B/param, plus one fp32 `step`
  scalar per parameter tensor: fp32 master + two moments, 12 B/param (7B: 84 GB, 10.5 GB
  per rank under FSDP over 8 ranks).
- DDP replicates everything (gradients are views into its buckets, resident all the time);
  FSDP shards weights, gradients and optimizer state over W, but with gradient accumulation
  (sync off between micro-batches) FSDP2 holds unsharded fp32 gradients, 4 B/param more. On
  one process gradients are freed after each step and filled in during backward as
  activations are freed: the peak counts the larger of the two, not both.
- Activations: what autograd saves for backward, per token (T = s·b tokens per micro-batch).
  A Llama block with SDPA (flash attention: no s x s scores, no dropout) saves
  `act_bytes_per_hidden`·h + `act_bytes_per_kv`·h·kv_heads/a + `act_bytes_per_ffn`·ffn +
  4·a (log-sum-exp) + 8 bytes per token (the recipe's coefficients, counted with
  saved_tensors_hooks: fp32 32·h + 8·h·kv_heads/a + 16·ffn; bf16 and fp8 30·h +
  4·h·kv_heads/a + 8·ffn, the residual stream and RMSNorm internals staying fp32; k and v
  are saved at their own width, SDPA running grouped-query attention without repeating
  them). The head saves 4·V (fp32 log-softmax for the loss) + `head_bytes_per_hidden`·h +
  36. With activation checkpointing a checkpointed block keeps only its fp32 input (4·h per
  token), and one block's full activations are live again while it is recomputed in backward.
- FLOPs per token: 6N + 12·L·a·(h/a)·s (PaLM's MFU accounting).
- Step time: compute = (FLOPs per token + the forward recomputed under activation
  checkpointing: 2·N_blocks + 4·L·a·(h/a)·s per checkpointed block's share) x tokens per
  device per step / TFLOP/s (preflight: the measured GEMM rate; `liftoff plan`: the device's
  dense bf16 peak, an upper bound on speed); communication = DDP all-reduce of the fp32
  gradients, 4N bytes: 2(W-1)/W·4N / busbw, or FSDP: all-gather of the compute-dtype
  parameters (G = Σ numel x the recipe's copy bytes: 4N fp32, 2N bf16, ~1N fp8) in forward
  and again in backward for every micro-batch, and one reduce-scatter of the fp32 gradients:
  (W-1)/W·(2·accum·G + 4N) / busbw (with accum 1 and fp32: 3·(W-1)/W·4N). busbw: preflight's
  measure, or the per-GPU-type assumption in `components/devices.py` (NVLink within a node,
  the network across nodes). Assumes no overlap of communication and compute (an upper
  bound on step time). tokens/s = tokens per step / step time; MFU = FLOPs per token ·
  tokens/s / (peak · W), so recomputation and communication both bring it under 1.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from components.config import ModelConfig, Parallelism, TrainConfig
from components.model_math import host_memory_bytes, mfu, param_tensors, planned_flops_per_token
from components.precision import Recipe, recipe

GB = 1e9


@dataclass
class Plan:
    params: int
    param_tensors: int
    world: int
    weights_gb: float
    grads_gb: float
    optimizer_gb: float
    precision_copies_gb: float
    activations_gb: float
    total_gb: float
    flops_per_token: float
    recompute_flops_per_token: float  # the forward activation checkpointing runs again, not in MFU
    step_time_s: float | None
    tokens_per_s: float | None
    mfu: float | None
    compute_s: float | None
    comm_s: float | None

    def as_dict(self) -> dict:
        return asdict(self)


def weight_copies(
    tensors: list[tuple[str, int, bool]],
    layers: int,
    precision: Recipe,
    train: TrainConfig,
    sharded: bool,
    recompute: bool = True,
) -> float:
    """Bytes of compute copies of the weights live during a step, per device. Under DDP a
    checkpointed block saves no copies (autocast casts again in its recompute), so only the
    blocks without checkpointing hold them, plus (if `recompute`) the block being recomputed.
    `sharded`: FSDP over more than one rank."""

    def cost(kinds: tuple[str, ...]) -> float:
        return sum(
            n * precision.copy_bytes(kind in ("linear", "lm_head"), fp8, sharded, train)
            for kind, n, fp8 in tensors
            if kind in kinds
        )

    root = cost(("embed", "norm", "lm_head"))
    blocks = cost(("linear", "block_norm"))
    if sharded:
        return root + min(2, layers) * blocks / layers
    if not train.activation_checkpointing:
        return root + blocks
    kept = -(-layers // train.ac_every_n_blocks)
    return root + blocks * (layers - kept + (1 if recompute else 0)) / layers


def activation_bytes(model: ModelConfig, train: TrainConfig, seq_len: int, recompute: bool = True) -> float:
    """Bytes saved for backward by one micro-batch's forward, per device; with activation
    checkpointing plus (if `recompute`) one block's activations live during its recompute."""
    precision = recipe(train.precision)
    h, f, a, L = model.hidden_size, model.ffn_hidden_size, model.num_heads, model.num_layers
    kv = h // a * model.num_kv_heads  # the width of k and v
    tokens = seq_len * train.micro_batch_size
    per_token = precision.act_bytes_per_hidden * h + precision.act_bytes_per_kv * kv + precision.act_bytes_per_ffn * f
    block = tokens * (per_token + 4 * a + 8)
    head = tokens * (4 * (model.vocab_size or 0) + precision.head_bytes_per_hidden * h + 36)
    if not train.activation_checkpointing:
        return L * block + head
    kept = -(-L // train.ac_every_n_blocks)  # checkpointed blocks keep their fp32 input only
    return kept * tokens * 4 * h + (L - kept) * block + head + (block if recompute else 0.0)


def checkpointed_blocks(model: ModelConfig, train: TrainConfig) -> int:
    return -(-model.num_layers // train.ac_every_n_blocks) if train.activation_checkpointing else 0


def comm_bytes(tensors: list[tuple[str, int, bool]], precision: Recipe, train: TrainConfig) -> float:
    """Bytes one rank sends per step before the ring's (W-1)/W: DDP all-reduces the fp32
    gradients (2 x 4N); FSDP all-gathers the compute-dtype parameters in forward and backward
    of every micro-batch and reduce-scatters the fp32 gradients once."""
    n = sum(t[1] for t in tensors)
    if train.parallelism != Parallelism.fsdp:
        return 2 * 4 * n
    gathered = sum(
        k * precision.copy_bytes(kind in ("linear", "lm_head"), fp8, True, train) for kind, k, fp8 in tensors
    )
    return 2 * train.grad_accum_steps * gathered + 4 * n


def plan(
    model: ModelConfig,
    train: TrainConfig,
    world: int,
    seq_len: int,
    vocab_size: int | None = None,
    tflops: float | None = None,
    peak_tflops: float | None = None,
    busbw_gbps: float | None = None,
) -> Plan:
    if vocab_size is not None and model.vocab_size is None:
        model = ModelConfig(**{**asdict(model), "vocab_size": vocab_size})
    tensors = param_tensors(model)
    n = sum(t[1] for t in tensors)
    sharded = train.parallelism == Parallelism.fsdp and world > 1
    shard = world if sharded else 1
    weights = 4 * n / shard
    grads = 4 * n / shard
    if sharded and train.grad_accum_steps > 1:
        grads += 4 * n  # with gradient sync off between micro-batches FSDP2 keeps unsharded fp32 grads
    optimizer = (8 * n + 4 * len(tensors)) / shard
    precision = recipe(train.precision)
    copies = weight_copies(tensors, model.num_layers, precision, train, sharded)
    acts = activation_bytes(model, train, seq_len)
    if world == 1:  # no DDP buckets: gradients are freed after each step and fill in as backward frees activations
        total = weights + optimizer + copies + max(grads, acts)
    else:
        total = weights + grads + optimizer + copies + acts
    h, a, s, b, L = model.hidden_size, model.num_heads, seq_len, train.micro_batch_size, model.num_layers
    head_dim = h // a
    fpt = planned_flops_per_token(model, s)
    n_blocks = sum(k for kind, k, _ in tensors if kind in ("linear", "block_norm"))
    recompute = checkpointed_blocks(model, train) / L * (2 * n_blocks + 4 * L * a * head_dim * s)
    step = compute = comm = tps = utilization = None
    if tflops:
        tokens_per_device = b * train.grad_accum_steps * s
        compute = (fpt + recompute) * tokens_per_device / (tflops * 1e12)
        comm = 0.0
        if world > 1 and busbw_gbps:  # without a bus bandwidth, communication is left out
            comm = comm_bytes(tensors, precision, train) * (world - 1) / world / (busbw_gbps * GB)
        step = compute + comm
        tps = tokens_per_device * world / step
        utilization = mfu(tps, fpt, peak_tflops or tflops, world)
    return Plan(
        params=n,
        param_tensors=len(tensors),
        world=world,
        weights_gb=weights / GB,
        grads_gb=grads / GB,
        optimizer_gb=optimizer / GB,
        precision_copies_gb=copies / GB,
        activations_gb=acts / GB,
        total_gb=total / GB,
        flops_per_token=fpt,
        recompute_flops_per_token=recompute,
        step_time_s=step,
        tokens_per_s=tps,
        mfu=utilization,
        compute_s=compute,
        comm_s=comm,
    )


def format_plan(p: Plan, device_memory_gb: float, safety: float) -> str:
    rows = [
        ("parameters", f"{p.params:,}"),
        ("world size", str(p.world)),
        ("weights", f"{p.weights_gb:.3f} GB"),
        ("gradients", f"{p.grads_gb:.3f} GB"),
        ("AdamW state", f"{p.optimizer_gb:.3f} GB"),
        ("precision copies", f"{p.precision_copies_gb:.3f} GB"),
        ("activations", f"{p.activations_gb:.3f} GB"),
        ("total per device", f"{p.total_gb:.3f} GB"),
        ("budget per device", f"{device_memory_gb * safety:.3f} GB ({device_memory_gb:.1f} GB x {safety})"),
        ("FLOPs per token", f"{p.flops_per_token:.4g}"
         + (f" (+ {p.recompute_flops_per_token:.4g} recomputed)" if p.recompute_flops_per_token else "")),
    ]  # fmt: skip
    if p.step_time_s is not None:
        rows += [
            ("step time", f"{p.step_time_s:.4g} s (compute {p.compute_s:.4g} s, comm {p.comm_s:.4g} s, no overlap)"),
            ("tokens/s", f"{p.tokens_per_s:,.0f}"),
            ("MFU", f"{p.mfu:.1%}"),
        ]
    return _rows(rows)


def _rows(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def fits(p: Plan, device_memory_gb: float, safety: float) -> bool:
    return p.total_gb <= device_memory_gb * safety


def host_memory_gb() -> float:
    """This machine's RAM: a CPU "device"'s memory."""

    return host_memory_bytes() / 1e9


@dataclass
class PlanDevice:
    """What a config's plan is judged and timed against, and where each figure comes from."""

    name: str
    memory_gb: float
    memory_source: str
    peak_tflops: float | None
    peak_source: str
    busbw_gbps: float | None
    busbw_source: str


def plan_device(cfg) -> PlanDevice:
    """Device memory: `preflight.device_memory_gb`, else the device table by `cluster.gpu_type`,
    else this host's RAM. Peak: `train.peak_tflops`, else the table's dense bf16 peak. Bus
    bandwidth: the table's assumption for one node or for the network across nodes."""
    from components.devices import busbw_gbps, device

    gpu = cfg.cluster.gpu_type
    spec = device(gpu) if gpu else None
    table = f"cluster.gpu_type={gpu} (components/devices.py)"
    if cfg.preflight.device_memory_gb:
        memory, memory_source = cfg.preflight.device_memory_gb, "preflight.device_memory_gb"
    elif spec:
        memory, memory_source = spec.memory_gb, table
    else:
        memory, memory_source = host_memory_gb(), "this host's RAM (cluster.gpu_type is null)"
    if cfg.train.peak_tflops:
        peak, peak_source = cfg.train.peak_tflops, "train.peak_tflops"
    elif spec:
        peak, peak_source = spec.peak_tflops["bf16"], f"dense bf16, {table}"
    else:
        peak, peak_source = None, "unknown: set cluster.gpu_type or train.peak_tflops for step time and MFU"
    nodes, world = cfg.cluster.nodes, cfg.cluster.nodes * cfg.cluster.procs_per_node
    if world == 1:
        busbw, busbw_source = None, "one device: no communication"
    elif spec:
        link = "NVLink within one node" if nodes == 1 else "the network across nodes"
        busbw, busbw_source = busbw_gbps(spec, nodes), f"assumed, {link} ({gpu}, components/devices.py)"
    else:
        busbw, busbw_source = None, "unknown without cluster.gpu_type: communication left out"
    return PlanDevice(gpu or "this host", memory, memory_source, peak, peak_source, busbw, busbw_source)


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
        tflops=d.peak_tflops,
        peak_tflops=d.peak_tflops,
        busbw_gbps=d.busbw_gbps,
    )
    return p, d


def seq_len_source(overrides: list[str]) -> str:
    """Who set data.seq_len: an override, the experiment preset, or the data group."""
    from omegaconf import DictConfig, OmegaConf

    from components.config import CONF_DIR

    given = dict(o.lstrip("+~").split("=", 1) for o in overrides if "=" in o)
    if "data.seq_len" in given:
        return "data.seq_len, your override"
    defaults = [d for d in OmegaConf.load(CONF_DIR / "config.yaml").defaults if isinstance(d, DictConfig)]
    chosen = {**{k: v for d in defaults for k, v in d.items()}, **given}
    preset = CONF_DIR / "experiment" / f"{chosen.get('experiment')}.yaml"
    if preset.is_file() and "seq_len" in (OmegaConf.load(preset).get("data") or {}):
        return f"data.seq_len, set by experiment={chosen['experiment']}"
    return f"data.seq_len, data={chosen.get('data')}"


def global_batch(cfg) -> int:
    return cfg.train.micro_batch_size * cfg.train.grad_accum_steps * cfg.cluster.nodes * cfg.cluster.procs_per_node


def format_inputs(cfg, p: Plan, d: PlanDevice, seq_source: str) -> str:
    t, c = cfg.train, cfg.cluster
    ac = f"on, every {t.ac_every_n_blocks} block(s)" if t.activation_checkpointing else "off"
    fp8 = f" ({t.fp8_recipe.value})" if t.precision.value == "fp8" else ""
    busbw = f"{d.busbw_gbps:g} GB/s per GPU: " if d.busbw_gbps else ""
    return _rows([
        ("model", f"{cfg.model.name}: {p.params / 1e9:.3g}B parameters, max_seq_len {cfg.model.max_seq_len}"),
        ("seq_len", f"{cfg.data.seq_len} ({seq_source})"),
        ("micro batch", f"{t.micro_batch_size} (train.micro_batch_size)"),
        ("grad accumulation", f"{t.grad_accum_steps} (train.grad_accum_steps)"),
        ("world size", f"{p.world} ({c.nodes} nodes x {c.procs_per_node} procs)"),
        ("global batch", f"{global_batch(cfg):,} sequences, {global_batch(cfg) * cfg.data.seq_len:,} tokens"),
        ("precision", f"{t.precision.value}{fp8}"),
        ("parallelism", t.parallelism.value),
        ("activation ckpt", ac),
        ("device", d.name),
        ("device memory", f"{d.memory_gb:.1f} GB: {d.memory_source}"),
        ("peak", f"{d.peak_tflops:g} TFLOP/s: {d.peak_source}" if d.peak_tflops else d.peak_source),
        ("bus bandwidth", busbw + d.busbw_source),
    ])  # fmt: skip


def plan_warnings(cfg, seq_source: str) -> list[str]:
    """Inputs that are likely not what a run of this model would use."""
    found = []
    s, full = cfg.data.seq_len, cfg.model.max_seq_len
    if s < full / 8:
        found.append(
            f"seq_len {s} ({seq_source}) is under model.max_seq_len/8 = {full // 8}: "
            f"model {cfg.model.name} trains at {full}; add data.seq_len={full} to plan at full length"
        )
    c = cfg.cluster
    if c.gpu > c.procs_per_node:
        found.append(
            f"cluster.procs_per_node={c.procs_per_node} but cluster.gpu={c.gpu}: "
            f"{c.gpu - c.procs_per_node} GPU(s) per node idle; cluster.procs_per_node={c.gpu} uses them all"
        )
    return found


AC, PARALLELISM, MICRO_BATCH = "train.activation_checkpointing", "train.parallelism", "train.micro_batch_size"
PROCS, NODES = "cluster.procs_per_node", "cluster.nodes"


def with_changes(cfg, changes: dict):
    """The config with `changes` ({"train.parallelism": Parallelism.fsdp, ...}) applied."""
    groups = {}
    for key, value in changes.items():
        group, name = key.split(".")
        groups.setdefault(group, {})[name] = value
    return replace(cfg, **{g: replace(getattr(cfg, g), **values) for g, values in groups.items()})


def _fits_with(cfg, changes: dict) -> bool:
    p, d = plan_for(with_changes(cfg, changes))
    return fits(p, d.memory_gb, cfg.preflight.memory_safety)


def _candidates(cfg):
    """Changes in order of cost, each adding to the last: activation checkpointing on, FSDP
    instead of DDP, the micro batch halved down to 1, every GPU of a node used, then 2x, 4x,
    8x and 16x the nodes."""
    t, c, changes = cfg.train, cfg.cluster, {}
    if not t.activation_checkpointing:
        changes[AC] = True
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
    for key in (AC, PARALLELISM, MICRO_BATCH, PROCS):
        fewer = {k: v for k, v in found.items() if k != key}
        if key in found and _fits_with(cfg, fewer):
            found = fewer
    return found


def as_overrides(changes: dict) -> list[str]:
    def text(v) -> str:
        return str(v).lower() if isinstance(v, bool) else str(getattr(v, "value", v))

    return [f"{k}={text(v)}" for k, v in changes.items()]


def format_suggestion(cfg, changes: dict | None) -> str:
    if changes is None:
        return (
            f"nothing fits up to {cfg.cluster.nodes * 16} nodes with activation checkpointing, FSDP and micro batch 1:"
            " a smaller model or a shorter data.seq_len"
        )
    changed = with_changes(cfg, changes)
    p, d = plan_for(changed)
    budget = d.memory_gb * cfg.preflight.memory_safety
    batch = global_batch(cfg), global_batch(changed)
    batch_note = f", global batch {batch[0]:,} -> {batch[1]:,} sequences" if batch[0] != batch[1] else ""
    return (
        f"{' '.join(as_overrides(changes))}  ({p.world} devices, {p.total_gb:.2f} of {budget:.2f} GB per device"
        f"{batch_note})"
    )
