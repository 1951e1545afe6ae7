"""The planner: memory per device, FLOPs, step time, tokens/s and MFU for a config, no hardware needed.

Formulas (N = parameters, W = data-parallel world size, s = seq len, b = micro batch,
h = hidden, L = layers, a = heads):

- Parameters N: embeddings V·h, per block q,o: h·h, k,v: h·(kv_heads·h/a), MLP 3·h·ffn,
  two RMSNorms 2·h; final norm h; output head V·h unless tied.
- Weights: this trainer keeps fp32 master weights as the parameters (4 B/param); bf16
  autocast caches a bf16 copy of every Linear weight in the forward (2 B/param); fp8 keeps
  an fp8 copy of each eligible weight and its transpose for backward (2 x 1 B/param).
- Gradients: fp32, 4 B/param. AdamW: two fp32 moments, 8 B/param, plus one fp32 `step`
  scalar per parameter tensor. Mixed-precision references: fp16/bf16 weights 2 B/param;
  fp32 master + two moments 12 B/param (7B: 14 GB of weights, 84 GB of optimizer state,
  10.5 GB per rank over 8 ranks).
- DDP replicates everything; FSDP shards weights, gradients and optimizer state over W.
- Activations per block (Korthikanti et al. 2022, 2-byte activations):
  s·b·h·(34 + 5·a·s/h) bytes, scaled by the compute dtype's bytes / 2. With activation
  checkpointing a checkpointed block keeps only its input (2·s·b·h · dtype/2), and one block's
  full activations are live during its recompute. Plus the logits: s·b·V·4 bytes (fp32 loss).
- FLOPs per token: 6N + 12·L·a·(h/a)·s (PaLM's MFU accounting).
- Step time: compute = FLOPs per device per step / achieved TFLOP/s of the compute dtype;
  communication = DDP all-reduce of 4N gradient bytes: 4N·2(W-1)/W / busbw, or FSDP
  all-gather (forward + backward) and reduce-scatter: 3·4N·(W-1)/W / busbw. Assumes no
  overlap (an upper bound). tokens/s = tokens per step / step time; MFU = FLOPs per token ·
  tokens/s / (peak · W).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from components.config import ModelConfig, Parallelism, Precision, TrainConfig

GB = 1e9
DTYPE_BYTES = {Precision.fp32: 4, Precision.bf16: 2, Precision.fp8: 2}  # fp8 training keeps bf16/fp32 activations


def weights_bytes(n_params: float, dtype: str) -> float:
    return n_params * {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}[dtype]


def adam_mixed_precision_bytes(n_params: float) -> float:
    """fp32 master weights + two fp32 moments: 12 bytes per parameter."""
    return n_params * 12


def sharded(total: float, world: int) -> float:
    return total / world


def param_tensors(model: ModelConfig) -> list[tuple[str, int, bool]]:
    """(name, numel, is an fp8-eligible Linear weight) for every parameter tensor."""
    h, v = model.hidden_size, model.vocab_size or 0
    head_dim = h // model.num_heads
    kv = model.num_kv_heads * head_dim
    eligible = lambda i, o: i % 16 == 0 and o % 16 == 0  # noqa: E731
    out = [("embed", v * h, False)]
    for _ in range(model.num_layers):
        for i, o in [
            (h, h),
            (h, kv),
            (h, kv),
            (h, h),
            (h, model.ffn_hidden_size),
            (h, model.ffn_hidden_size),
            (model.ffn_hidden_size, h),
        ]:
            out.append(("linear", i * o, eligible(i, o)))
        out += [("norm", h, False), ("norm", h, False)]
    out.append(("norm", h, False))
    if not model.tie_embeddings:
        out.append(("lm_head", v * h, False))
    return out


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
    step_time_s: float | None
    tokens_per_s: float | None
    mfu: float | None
    compute_s: float | None
    comm_s: float | None

    def as_dict(self) -> dict:
        return asdict(self)


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
    n_linear = sum(t[1] for t in tensors if t[0] == "linear")
    n_fp8 = sum(t[1] for t in tensors if t[2])
    shard = world if train.parallelism == Parallelism.fsdp else 1
    weights = 4 * n / shard
    grads = 4 * n / shard
    optimizer = (8 * n + 4 * len(tensors)) / shard
    copies = {Precision.fp32: 0, Precision.bf16: 2 * n_linear, Precision.fp8: 2 * n_fp8}[train.precision] / shard
    h, a, s, b, L = model.hidden_size, model.num_heads, seq_len, train.micro_batch_size, model.num_layers
    scale = DTYPE_BYTES[train.precision] / 2
    block = s * b * h * (34 + 5 * a * s / h) * scale
    if train.activation_checkpointing:
        kept = -(-L // train.ac_every_n_blocks)
        acts = kept * 2 * s * b * h * scale + (L - kept) * block + block
    else:
        acts = L * block
    acts += s * b * (model.vocab_size or 0) * 4
    total = weights + grads + optimizer + copies + acts
    head_dim = h // a
    n_no_embed = n - (model.vocab_size or 0) * h
    fpt = 6 * n_no_embed + 12 * L * a * head_dim * s
    step = compute = comm = tps = mfu = None
    if tflops:
        tokens_per_device = b * train.grad_accum_steps * s
        compute = fpt * tokens_per_device / (tflops * 1e12)
        comm = 0.0
        if world > 1 and busbw_gbps:
            factor = 3 * (world - 1) / world if train.parallelism == Parallelism.fsdp else 2 * (world - 1) / world
            comm = 4 * n * factor / (busbw_gbps * GB)
        step = compute + comm  # without a measured bus bandwidth, communication is left out
        tps = tokens_per_device * world / step
        mfu = fpt * tps / ((peak_tflops or tflops) * 1e12 * world)
    return Plan(
        n,
        len(tensors),
        world,
        weights / GB,
        grads / GB,
        optimizer / GB,
        copies / GB,
        acts / GB,
        total / GB,
        fpt,
        step,
        tps,
        mfu,
        compute,
        comm,
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
        ("FLOPs per token", f"{p.flops_per_token:.4g}"),
    ]
    if p.step_time_s is not None:
        rows += [
            ("step time", f"{p.step_time_s:.4g} s (compute {p.compute_s:.4g} s, comm {p.comm_s:.4g} s)"),
            ("tokens/s", f"{p.tokens_per_s:,.0f}"),
            ("MFU", f"{p.mfu:.1%}"),
        ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def fits(p: Plan, device_memory_gb: float, safety: float) -> bool:
    return p.total_gb <= device_memory_gb * safety
