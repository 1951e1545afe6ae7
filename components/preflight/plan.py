"""The planner: memory per device, FLOPs, step time, tokens/s and MFU for a config, no hardware needed.
A composed config's plan, its device and the changes that make it fit: `plan_config.py`; what
`liftoff plan` prints: `plan_format.py`.

Formulas (N = parameters, W = data-parallel world size, s = seq len, b = micro batch,
h = hidden, L = layers, a = heads):

- Parameters N: embeddings V·h, per block q,o: h·h, k,v: h·(kv_heads·h/a), MLP 3·h·ffn,
  two RMSNorms 2·h; final norm h; output head V·h unless tied.
- Weights: this trainer keeps fp32 master weights as the parameters (4 B/param). Compute
  copies come from the precision recipe (`components/precision`): under DDP, bf16 autocast
  caches a bf16 copy of every Linear weight for the step (2 B/param), while fp8 casts of the
  Float8Linear weights are transient; under FSDP the unsharded parameters of the root (kept
  through the step) and of two blocks (computing + prefetched) exist at the compute dtype
  (fp8 all-gather: 1 B for the Float8Linear weights); under pipeline parallelism all of a
  stage's blocks (the schedule keeps them unsharded from the first backward to the step's end).
- Gradients: fp32, 4 B/param. AdamW: two fp32 moments, 8 B/param, plus one fp32 `step`
  scalar per parameter tensor: fp32 master + two moments, 12 B/param (7B: 84 GB, 10.5 GB
  per rank under FSDP over 8 ranks).
- DDP replicates everything (gradients are views into its buckets, resident all the time);
  FSDP shards weights, gradients and optimizer state over W. With gradient accumulation FSDP
  reduce-scatters after every micro-batch by default (`train.fsdp_sync_every_microbatch`), so
  only gradient shards accumulate; with the sync off between micro-batches FSDP2 holds
  unsharded fp32 gradients, 4 B/param more, for 1/accum of the reduce-scatter traffic; under
  pipeline parallelism always (torch's schedules sync a stage once, at the step's end). On
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
  36. With full activation checkpointing a checkpointed block keeps only its fp32 input (4·h
  per token); with selective (every block, components/parallel/checkpointing.py's rule) also
  q, v, gate and attention's output (c·(2h + kv + ffn) / tp at the compute dtype's c bytes),
  down's partial sum (c·h, whole) and the log-sum-exp (4·a / tp); either way one block's full
  activations are live again while it is recomputed in backward.
- FLOPs per token: 6N + 12·L·a·(h/a)·s (PaLM's MFU accounting).
- Step time: compute = (FLOPs per token + the forward recomputed under activation
  checkpointing: 2·N_blocks + 4·L·a·(h/a)·s per checkpointed block's share) x tokens per
  device per step / TFLOP/s (preflight: the measured GEMM rate; `liftoff plan`: the device's
  dense bf16 peak x its efficiency for the precision recipe, `efficiency_for` in
  `components/devices.py`); communication = DDP all-reduce of the fp32
  gradients, 4N bytes: 2(W-1)/W·4N / busbw, or FSDP: all-gather of the compute-dtype
  parameters (G = Σ numel x the recipe's copy bytes: 4N fp32, 2N bf16, ~1N fp8) in forward
  and again in backward for every micro-batch, and a reduce-scatter of the fp32 gradients
  after every micro-batch (R = accum) or only the last (R = 1):
  (W-1)/W·(2·accum·G + R·4N) / busbw (with accum 1 and fp32: 3·(W-1)/W·4N). busbw: preflight's
  measure, or the per-GPU-type assumption in `components/devices.py` (NVLink within a node,
  the network across nodes). FSDP2 gathers the next block during this one's compute and
  reduces a block's gradients during the next one's backward (DDP its buckets during
  backward), so only what outlasts compute and one block's share wait (`unhidden`); under
  pipeline parallelism a stage is gathered once a step. TP's and PP's traffic waits in full.
  HSDP (`train.dp_replicate` = R): everything FSDP shards is sharded over
  S = W/R ranks only (a shard group: consecutive ranks, one node's GPUs when S = procs per
  node), the FSDP traffic above runs within a group at its bus bandwidth ((S-1)/S instead of
  (W-1)/W, NVLink when the group is one node), and each step the fp32 gradient shard (4N/S)
  is all-reduced across the R replicas: 2(R-1)/R·4N/S at the network's. tokens/s = tokens
  per step / step time; MFU = FLOPs per token · tokens/s / (peak · W), so recomputation and
  communication both bring it under the device's efficiency.
- Tensor parallelism (`train.tp` = T; the data-parallel world is W/T, and everything above
  that says W means it): a tp rank holds 1/T of the blocks' Linears and of the head and the
  whole embeddings and norms; weights, gradients, Adam state and compute copies follow. What
  attention and the MLP save splits over T, the residual stream, the norms and the gathered
  logits do not without sequence parallel (with it they split too, see `activation_bytes`,
  and the embedding splits by vocabulary). Compute per device is 1/T of a data-parallel
  rank's; communication adds, per micro-batch, 7 all-reduces per block of T·h activations at
  the compute dtype (2 forward, 5 backward: one per colwise Linear's input gradient; 2 more
  per checkpointed block's recompute), the head's logits all-gather and its input-gradient
  all-reduce, over the tp group's bus bandwidth (NVLink: the group is T consecutive ranks of
  one node).
- Pipeline parallelism (`train.pp` = P, v stages per rank: 1, interleaved 2; m pipeline
  micro-batches: `grad_accum_steps`, or P parts of the step's batch when fewer; the
  data-parallel world is W/(T·P)): the blocks cut as
  the trainer cuts them (`model_math.stage_layers`), pipeline rank r holding stages r + k·P,
  the embeddings on rank 0, the final norm and head on rank P-1; the plan is the larger of the
  two end ranks. Activations: each of rank r's stages keeps the micro-batches it has run
  forward and not yet backward, at most min(m, P-r) under 1F1B (the last stage 1), m under
  GPipe, and under interleaved 1F1B the warm-up torch's schedule runs, (v-1)·m/rounds +
  2(P-1-r) + 1 stage-micro-batches (rounds = max(1, m // P)). Compute per device is 1/P of a
  data-parallel rank's, times the bubble (m·v + P - 1)/(m·v); each rank sends, per
  micro-batch and stage it holds, its output activations forward and its input gradient
  backward (T·h each at the compute dtype) over the network (P spans nodes).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from components.config import ActivationCheckpointing, ModelConfig, Parallelism, TrainConfig
from components.config.bounds import PIPELINE_SCHEDULES
from components.model_math import (
    BLOCK_KINDS,
    MATMUL_KINDS,
    active,
    host_memory_bytes,
    mfu,
    param_tensors,
    planned_flops_per_token,
    stage_layers,
)
from components.parallel import ParallelDims, pipeline_microbatches, sequence_parallel
from components.precision import Recipe, recipe
from components.summaries import gib

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
    exposed_comm_s: float | None = None  # what of comm_s compute does not hide
    host_s: float | None = None  # the host's dispatch of a step (preflight's host_step_s), where measured

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
    `sharded`: FSDP over more than one rank; under pipeline parallelism torch's schedules keep
    a stage's parameters unsharded from its first backward to the step's end
    (`set_reshard_after_backward(False)`): all its blocks' copies are live."""

    def cost(kinds: tuple[str, ...]) -> float:
        return sum(
            n * precision.copy_bytes(kind in MATMUL_KINDS, fp8, sharded, train)
            for kind, n, fp8 in tensors
            if kind in kinds
        )

    root = cost(("embed", "norm", "head"))
    blocks = cost(BLOCK_KINDS)
    if sharded:
        return root + (blocks if train.pp > 1 else min(2, layers) * blocks / layers)
    if not train.activation_checkpointing:
        return root + blocks
    kept = checkpointed(layers, train)
    return root + blocks * (layers - kept + (1 if recompute else 0)) / layers


def activation_bytes(
    model: ModelConfig,
    train: TrainConfig,
    seq_len: int,
    recompute: bool = True,
    head_too: bool = True,
    sp: bool = False,
    fsdp: bool = False,
    recompute_extra: float = 0.0,
) -> float:
    """Bytes saved for backward by one micro-batch's forward, per device; with activation
    checkpointing plus (if `recompute`) one block's activations live during its recompute.
    Under tensor parallelism (`train.tp`) what attention and the MLP save splits with the
    heads and FFN columns; without sequence parallel (`sp`) the residual stream, the norms and
    the head's logits are whole on every rank, with it they split too (along the sequence, the
    logits along the vocabulary: the loss-parallel head). Under FSDP (`fsdp`) the mixed-precision
    policy's residual stream and checkpointed inputs are in the compute dtype. At the peak the
    loss's transient or one block's recompute (with `recompute_extra`, autocast's copies of its
    weights) is live, whichever is larger."""
    precision = recipe(train.precision)
    h, f, a, L = model.hidden_size, model.ffn_hidden_size, model.num_heads, model.num_layers
    kv = h // a * model.num_kv_heads  # the width of k and v
    tokens, tp = seq_len * train.micro_batch_size, train.tp
    sp = sp and tp > 1
    whole_h, split_h, per_kv, per_ffn = precision.block_act_bytes(tp, sp, fsdp)
    norms = 8  # the two RMSNorms' fp32 reciprocal RMS per token: split along the sequence under sp
    whole = whole_h * h + (0 if sp else norms)
    f *= model.experts_per_token or 1  # a mixture of experts: each token through that many expert MLPs
    router = 8 * model.num_experts  # its fp32 logits and softmax (a rough count: not held to a measurement)
    heads = split_h * h + per_kv * kv + per_ffn * f + 4 * a + (norms if sp else 0) + router
    block = tokens * (whole + heads / tp)
    head_per_h = precision.fsdp_head_bytes_per_hidden if fsdp else precision.head_bytes_per_hidden
    v, head_h = model.vocab_size or 0, head_per_h * h + 36
    logits = 4 * v  # what the loss keeps of a token's logits: the fp32 log-softmax
    if chunked_loss(train, tokens, sp):  # or, chunked, the head's output in the compute dtype
        logits = v * precision.compute_bytes
    if not head_too:
        head = 0.0
    elif sp:  # the fp32 logits and the final norm's tensors split; the head's gathered input whole
        norm = 6 if fsdp and precision.compute_dtype != "float32" else 8  # its fp32 internals: 8 B, 6 in FSDP's
        head = tokens * ((logits + norm * h + 4) / tp + head_h - norm * h - 4)
    else:
        head = tokens * (logits + head_h)
    # a checkpointed block's recompute comes later than the loss's transient, when it is gone
    transient = loss_transient(model, train, seq_len, sp) if recompute and head_too else 0.0
    if not train.activation_checkpointing:
        return L * block + head + transient
    kept = checkpointed(L, train)  # checkpointed blocks keep their input (fp32, or bf16 under FSDP's policy)
    i = precision.input_bytes(fsdp)
    if train.activation_checkpointing == ActivationCheckpointing.selective:  # and the outputs the rule saves
        c = precision.compute_bytes
        saved = c * (h + kv + f + h) + 4 * a  # q, v, gate and attention's output (split), its log-sum-exp
        if sp:  # the input and o's and down's reduce-scattered outputs split; a gathered input whole
            kept_bytes = tokens * (c * h + (i * h + 2 * c * h + saved) / tp)
        else:
            kept_bytes = tokens * (i * h + c * h + saved / tp)  # the input, down's partial sum (whole)
    else:
        kept_bytes = tokens * i * h / (tp if sp else 1)
    return (
        kept * kept_bytes + (L - kept) * block + head + (max(block + recompute_extra, transient) if recompute else 0.0)
    )


def loss_transient(model: ModelConfig, train: TrainConfig, seq_len: int, sp: bool) -> float:
    """Bytes the loss holds for a moment beside everything saved: backward of the fp32
    log-softmax holds its incoming and outgoing gradients (two fp32 tokens x vocabulary tensors;
    a loss-parallel head's three, split over tp). Chunked (`train.loss_chunk_tokens`): the
    logits' gradient in their dtype (c B) and a chunk's two fp32 gradients, with a bf16 head its
    bf16 one too. Counted by torch's MemTracker at the peak (benchmarks/planner_accuracy.py's
    `peak_` rows)."""
    tokens, v = seq_len * train.micro_batch_size, model.vocab_size or 0
    if sp and train.tp > 1:
        return 12 * tokens * v / train.tp
    if chunked_loss(train, tokens, sp):
        c = recipe(train.precision).compute_bytes
        return c * tokens * v + (8 + (c if c < 4 else 0)) * train.loss_chunk_tokens * v
    return 8 * tokens * v


def chunked_loss(train: TrainConfig, tokens: int, sp: bool) -> bool:
    """Whether the loss runs in chunks (components/models/token_loss): a chunk size under the
    micro-batch's tokens, and no loss-parallel head."""
    return 0 < train.loss_chunk_tokens < tokens and not (sp and train.tp > 1)


def checkpointed(layers: int, train: TrainConfig) -> int:
    """Blocks under activation checkpointing: every n-th (full) or every one (selective)."""
    if not train.activation_checkpointing:
        return 0
    if train.activation_checkpointing == ActivationCheckpointing.selective:
        return layers
    return -(-layers // train.ac_every_n_blocks)


def in_flight(schedule: str, pp: int, micro: int, rank: int) -> int:
    """Stage-micro-batches pipeline rank `rank` has run forward and not yet backward at its peak."""
    if schedule == "gpipe":
        return micro * PIPELINE_SCHEDULES[schedule]
    if PIPELINE_SCHEDULES[schedule] == 1:
        return min(micro, pp - rank)
    v, rounds = PIPELINE_SCHEDULES[schedule], max(1, micro // pp)
    return min(micro * v, (v - 1) * (micro // rounds) + 2 * (pp - 1 - rank) + 1)


@dataclass(frozen=True)
class PipelineShare:
    """What one pipeline rank holds: its blocks, whether it has the embeddings (rank 0) and
    the final norm and head (the last), and its stage-micro-batches in flight."""

    rank: int
    layers: int
    first: bool
    last: bool
    in_flight: int


def pipeline_shares(model: ModelConfig, train: TrainConfig) -> list[PipelineShare]:
    """The two end ranks of the pipeline (one process when train.pp is 1): whichever holds more."""
    pp, v = train.pp, PIPELINE_SCHEDULES.get(train.pp_schedule, 1)
    if pp == 1:
        return [PipelineShare(0, model.num_layers, True, True, 1)]
    stages = stage_layers(model.num_layers, pp * v)
    shares = []
    for r in sorted({0, pp - 1}):
        layers = sum(len(stages[s]) for s in range(r, pp * v, pp))
        shares.append(
            PipelineShare(r, layers, r == 0, r == pp - 1, in_flight(train.pp_schedule, pp, train.grad_accum_steps, r))
        )
    return shares


def pipeline_activations(
    model: ModelConfig,
    train: TrainConfig,
    seq_len: int,
    share: PipelineShare,
    fsdp: bool = False,
    sp: bool = False,
    loss: bool = True,
) -> float:
    """A pipeline rank's saved activations at its peak: its stage-micro-batches in flight,
    each one stage's blocks' worth; the head's on the last rank (once under 1F1B: it runs
    backward right after forward; with every micro-batch under GPipe); plus one block live
    in its recompute under activation checkpointing or, on the last rank, the loss's transient
    where larger (`loss`: False for the saved tensors alone). `fsdp`, `sp`: as `activation_bytes`."""
    v = PIPELINE_SCHEDULES[train.pp_schedule]
    mine = ModelConfig(**{**asdict(model), "num_layers": share.layers})
    blocks = activation_bytes(mine, train, seq_len, recompute=False, head_too=False, sp=sp, fsdp=fsdp)
    recompute = activation_bytes(mine, train, seq_len, head_too=False, sp=sp, fsdp=fsdp) - blocks
    if share.last and loss:  # and the loss's transient, when it outlasts a block's recompute
        recompute = max(recompute, loss_transient(model, train, seq_len, sp))
    ends = ModelConfig(**{**asdict(model), "num_layers": 0})
    head = activation_bytes(ends, train, seq_len, recompute=False, sp=sp, fsdp=fsdp)
    heads = (train.grad_accum_steps if train.pp_schedule == "gpipe" else 1) * head if share.last else 0.0
    return share.in_flight * blocks / v + heads + recompute


def pipeline_local(tensors: list[tuple[str, int, bool]], model: ModelConfig, share: PipelineShare) -> list:
    """The parameter tensors of one pipeline rank: its blocks' (all blocks alike), the
    embeddings on the first, the final norm and the head on the last."""
    per_block = sum(kind in BLOCK_KINDS for kind, _, _ in tensors) // model.num_layers
    blocks = [t for t in tensors if t[0] in BLOCK_KINDS][: share.layers * per_block]
    ends = [t for t in tensors if (t[0] == "embed" and share.first) or (t[0] in ("norm", "head") and share.last)]
    return ends + blocks


def recomputed_flops(model: ModelConfig, train: TrainConfig, n_blocks: int, seq_len: int) -> float:
    """Forward FLOPs per token done again in backward: a fully checkpointed block's whole
    forward (2 x its parameters + attention's 4·a·(h/a)·s); under selective checkpointing only
    the matmuls whose outputs the rule does not keep (k, o and up: attention is never redone)."""
    h, a, L = model.hidden_size, model.num_heads, model.num_layers
    if train.activation_checkpointing == ActivationCheckpointing.selective:
        kv = h // a * model.num_kv_heads
        experts = model.experts_per_token or 1  # up: in each expert a token is routed to
        return 2 * L * (h * kv + h * h + h * model.ffn_hidden_size * experts)
    return checkpointed(model.num_layers, train) / L * (2 * n_blocks + 4 * L * h * seq_len)


def attention_flops(model: ModelConfig, train: TrainConfig, seq_len: int) -> float:
    """Of a token's training FLOPs (its recomputation counted), attention's scores and values
    (12·L·h·s as PaLM counts them; a fully checkpointed block's forward again, 4·h·s; selective
    checkpointing never redoes attention): flash attention runs them in bf16 whatever the recipe."""
    h, L = model.num_heads * (model.hidden_size // model.num_heads), model.num_layers
    again = checkpointed(L, train) if train.activation_checkpointing == ActivationCheckpointing.full else 0
    return 12 * L * h * seq_len + 4 * again * h * seq_len


def comm_bytes(tensors: list[tuple[str, int, bool]], precision: Recipe, train: TrainConfig) -> float:
    """Bytes one rank sends per step before the ring's (W-1)/W: DDP all-reduces the fp32
    gradients (2 x 4N); FSDP all-gathers the compute-dtype parameters in forward and backward
    of every micro-batch and reduce-scatters the fp32 gradients after each micro-batch (or,
    with `fsdp_sync_every_microbatch` off, after the last only)."""
    n = sum(t[1] for t in tensors)
    if train.parallelism != Parallelism.fsdp:
        return 2 * 4 * n
    gathered = sum(k * precision.copy_bytes(kind in MATMUL_KINDS, fp8, True, train) for kind, k, fp8 in tensors)
    reductions = 1 if syncs_only_the_last(train) else train.grad_accum_steps
    # under pipeline parallelism a stage is gathered once a step (kept unsharded after forward, as
    # torchtitan does: the schedule runs every micro-batch through it); else forward and backward each
    gathers = 1 if train.pp > 1 else 2 * train.grad_accum_steps
    return gathers * gathered + reductions * 4 * n


def unhidden(comm_s: float, compute_s: float, layers: int) -> float:
    """The data-parallel communication compute does not hide: FSDP2 all-gathers the next block
    while this one computes (forward and backward) and reduce-scatters a block's gradients while
    the one before it runs backward, DDP all-reduces a bucket while backward goes on; so each
    block's share waits only where it outlasts the compute beside it, and one block's share
    (the first all-gather, the last reduce) is never hidden."""
    if comm_s == 0:
        return 0.0
    return max(comm_s - compute_s, 0.0) + comm_s / max(layers, 1)


def syncs_only_the_last(train: TrainConfig) -> bool:
    """Whether FSDP reduce-scatters once a step, holding unsharded fp32 gradients between
    micro-batches: with `fsdp_sync_every_microbatch` off, and always under pipeline parallelism
    (torch's schedules turn the sync off for every micro-batch's backward and reduce once at
    the end of the step, `perform_reduce_grad`, whatever the setting)."""
    return train.grad_accum_steps > 1 and (not train.fsdp_sync_every_microbatch or train.pp > 1)


def tp_local(tensors: list[tuple[str, int, bool]], tp: int, sp: bool = False) -> list[tuple[str, int, bool]]:
    """Each parameter tensor's elements on one tp rank: the blocks' Linears and the head split
    over tp, the embedding too under sequence parallel (by vocabulary); norms whole (replicated)."""
    split = ("linear", "head", "embed") if sp else ("linear", "head")
    return [(kind, n // tp if kind in split else n, fp8) for kind, n, fp8 in tensors]


def tp_comm_bytes(
    model: ModelConfig, train: TrainConfig, seq_len: int, precision: Recipe, sp: bool = False, share=None
) -> float:
    """Bytes one tp rank sends per step before the ring's (tp-1)/tp, in all-reduces of 2 x T·h
    each at the compute dtype (an all-gather or a reduce-scatter is half of one). Per
    micro-batch and block: forward two (after o_proj and down_proj), again in a checkpointed
    block's recompute; backward one per colwise Linear (q, k, v, gate, up: each takes the whole
    input on its own). Under sequence parallel backward is two as well (the gathered input's
    gradient is summed over q, k, v, then reduce-scattered once; gate and up alike). An untied
    head all-gathers its logits (T·V) and all-reduces its input's gradient; under sequence
    parallel the embedding reduce-scatters, the head all-gathers its input and the loss-parallel
    cross-entropy reduces two floats a token (a tied one is computed whole). fp8 under sequence
    parallel all-gathers the Float8Linears' inputs in fp8 (torchao's float8 TP styles): the two
    forward all-gathers of a block (and of its recompute) move 1 B an element. `share`: a
    pipeline rank's (its blocks, the head on the last), else the whole model."""
    if train.tp == 1:
        return 0.0
    sp = sp and not model.tie_embeddings
    c = precision.compute_bytes
    t, h, v = seq_len * train.micro_batch_size, model.hidden_size, model.vocab_size or 0
    layers = share.layers if share is not None else model.num_layers
    ckpt = checkpointed(layers, train)
    all_reduces = (4 if sp else 7) * layers + 2 * ckpt
    if sp and precision.name == "fp8":  # an all-gather is half an all-reduce; at 1 B instead of c
        all_reduces -= (layers + ckpt) * (c - 1) / c
    if model.tie_embeddings or (share is not None and not share.last):
        head = 0
    elif sp:
        head = 2 * t * h * c + 2 * t * 4
    else:
        head = 2 * t * h * c + t * v * c
    return train.grad_accum_steps * (all_reduces * 2 * t * h * c + head)


def plan(
    model: ModelConfig,
    train: TrainConfig,
    world: int,
    seq_len: int,
    vocab_size: int | None = None,
    tflops: float | None = None,
    peak_tflops: float | None = None,
    busbw_gbps: float | None = None,
    replicate_busbw_gbps: float | None = None,
    tp_busbw_gbps: float | None = None,
    pp_busbw_gbps: float | None = None,
    cuda: bool = True,
    host_s: float | None = None,
    attention_tflops: float | None = None,
) -> Plan:
    """`busbw_gbps`: the bus bandwidth of the data-parallel group (for HSDP, of a shard group);
    `replicate_busbw_gbps`: HSDP's across its replicas; `tp_busbw_gbps`: a tp group's (None:
    the data-parallel group's); `pp_busbw_gbps`: between pipeline stages (None: HSDP's, the
    network's); `cuda`: planned for GPUs (fp8 runs sequence parallel only there); `host_s`: the
    host's dispatch of a step (preflight measures it): on a GPU the step lasts at least that
    long (kernels queue behind their launches), on a CPU it adds to compute (no queue). Under
    pipeline parallelism, the plan of the end rank that holds more."""
    if vocab_size is not None and model.vocab_size is None:
        model = ModelConfig(**{**asdict(model), "vocab_size": vocab_size})
    if train.pp > 1:  # the micro-batches the schedule runs (the step's batch split into >= pp of them)
        micro, size = pipeline_microbatches(train)
        train = replace(train, grad_accum_steps=micro, micro_batch_size=size)
    bw = (tflops, attention_tflops or tflops, peak_tflops, busbw_gbps, replicate_busbw_gbps, tp_busbw_gbps,
          pp_busbw_gbps)  # fmt: skip
    sp = sequence_parallel(train, model.tie_embeddings, cuda)
    plans = [_plan_rank(model, train, world, seq_len, share, sp, *bw) for share in pipeline_shares(model, train)]
    chosen = max(plans, key=lambda p: p.total_gb)
    if host_s and chosen.step_time_s:
        return with_host(chosen, host_s, cuda)
    return chosen


def with_host(p: Plan, host_s: float, cuda: bool) -> Plan:
    """The plan with the host's dispatch of a step in its step time: the longer of the two on a
    GPU (launches run ahead of the device), their sum on a CPU (one thread does both)."""
    step = max(p.step_time_s, host_s) if cuda else p.step_time_s + host_s
    scale = p.step_time_s / step
    mfu_ = p.mfu * scale if p.mfu is not None else None
    return replace(p, step_time_s=step, tokens_per_s=p.tokens_per_s * scale, mfu=mfu_, host_s=host_s)


def _plan_rank(model, train, world, seq_len, share, sp, tflops, attention_tflops, peak_tflops, busbw_gbps,
               replicate_busbw_gbps,
               tp_busbw_gbps, pp_busbw_gbps) -> Plan:  # fmt: skip
    tp, pp = train.tp, train.pp
    full = param_tensors(model)
    tensors = tp_local(pipeline_local(full, model, share), tp, sp)  # what one tp rank of this pipeline rank holds
    n = sum(t[1] for t in tensors)
    dims = ParallelDims.of(train, world)
    dp, sharded = dims.dp, dims.fsdp  # the data-parallel world; FSDP over it
    replicas = dims.dp_replicate if sharded else 1  # HSDP: shard groups of dp / dp_replicate ranks
    shard = dims.dp_shard if sharded else 1
    weights = 4 * n / shard
    grads = 4 * n / shard
    if sharded and syncs_only_the_last(train):
        grads += 4 * n  # with gradient sync off between micro-batches FSDP2 keeps unsharded fp32 grads
    optimizer = (8 * n + 4 * len(tensors)) / shard
    precision = recipe(train.precision)
    copies = weight_copies(tensors, share.layers, precision, train, sharded)
    if pp > 1:
        acts = pipeline_activations(model, train, seq_len, share, sharded, sp)
    else:  # a recomputed block's copies (autocast's) count only when its recompute is the peak
        kept = weight_copies(tensors, share.layers, precision, train, sharded, recompute=False)
        acts = activation_bytes(model, train, seq_len, sp=sp, fsdp=sharded, recompute_extra=copies - kept)
        copies = kept
    if world == 1:  # no DDP buckets: gradients are freed after each step and fill in as backward frees activations
        total = weights + optimizer + copies + max(grads, acts)
    else:
        total = weights + grads + optimizer + copies + acts
    s, b = seq_len, train.micro_batch_size
    fpt = planned_flops_per_token(model, s)
    n_blocks = sum(active(model, kind, k) for kind, k, _ in full if kind in BLOCK_KINDS)  # what a token multiplies
    recompute = recomputed_flops(model, train, n_blocks, s)
    step = compute = comm = tps = utilization = None
    if tflops:
        tokens_per_replica = b * train.grad_accum_steps * s  # what one data-parallel rank (its tp ranks) reads
        micro_stages = train.grad_accum_steps * PIPELINE_SCHEDULES.get(train.pp_schedule, 1)
        bubble = (micro_stages + pp - 1) / micro_stages if pp > 1 else 1.0  # idle while the pipeline fills, drains
        attention = attention_flops(model, train, s)  # of fpt + recompute: flash attention's, in bf16
        per_token = (fpt + recompute - attention) / tflops + attention / attention_tflops
        compute = per_token * tokens_per_replica / tp / pp * bubble / 1e12
        data_parallel = 0.0  # FSDP's / DDP's: hidden under compute, but what outlasts it
        if dp > 1 and busbw_gbps:  # without a bus bandwidth, communication is left out
            group = shard if sharded else dp
            data_parallel = comm_bytes(tensors, precision, train) * (group - 1) / group / (busbw_gbps * GB)
            if replicas > 1:  # HSDP: each step's gradient shard all-reduced across the replicas
                across = 2 * (replicas - 1) / replicas * 4 * n / shard
                data_parallel += across / ((replicate_busbw_gbps or busbw_gbps) * GB)
        links = (tp_busbw_gbps or busbw_gbps, pp_busbw_gbps or replicate_busbw_gbps or busbw_gbps)
        model_parallel, waits = model_parallel_comm(model, train, s, sp, share, compute, micro_stages, *links)
        comm = data_parallel + model_parallel
        exposed = waits + unhidden(data_parallel, compute, share.layers)
        step = compute + exposed
        tps = tokens_per_replica * dp / step
        utilization = mfu(tps, fpt, peak_tflops, world)  # against a published peak only, never a measured one
    return Plan(
        params=sum(t[1] for t in full),
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
        exposed_comm_s=exposed if tflops else None,
    )


def model_parallel_comm(model: ModelConfig, train: TrainConfig, seq_len: int, sp: bool, share: PipelineShare,
                        compute_s: float, micro_stages: int, tp_gbps: float | None,
                        pp_gbps: float | None) -> tuple[float, float]:  # fmt: skip
    """(seconds of TP's and PP's traffic a step, the seconds of it the step waits for): TP's
    per-layer collectives wait in full, but under async TP, where each runs in tp chunks beside
    its matmul's (over NVLink, not the network FSDP's traffic takes), only its first chunk and
    what outlasts compute wait; PP's sends (activations forward, their gradients backward) wait."""
    tp, traffic, waits = train.tp, 0.0, 0.0
    if tp > 1 and tp_gbps:
        tp_s = tp_comm_bytes(model, train, seq_len, recipe(train.precision), sp, share) * (tp - 1) / tp / (tp_gbps * GB)
        traffic += tp_s
        waits += (tp_s / tp + max(tp_s - compute_s, 0.0)) if train.async_tp else tp_s
    if train.pp > 1 and pp_gbps:
        c = recipe(train.precision).compute_bytes
        pp_s = 2 * micro_stages * train.micro_batch_size * seq_len * model.hidden_size * c / tp / (pp_gbps * GB)
        traffic += pp_s
        waits += pp_s
    return traffic, waits


def reserved_gb(p: Plan, headroom: float) -> float:
    """The plan's peak as the caching allocator reserves it: what tensors hold plus
    `preflight.memory_headroom` (its share of the reservation that holds none: blocks cached
    between sizes, fragmentation, NCCL and the CUDA context). 0.1 is FITTED: published peaks
    are torch's max reserved, 1.06-1.22x the planned tensors on the 8 rows the planner models
    (benchmarks/planner_vs_published.py), mean 1.11."""
    return p.total_gb / (1 - headroom)


def fits(p: Plan, device_memory_gb: float, headroom: float) -> bool:
    return reserved_gb(p, headroom) <= device_memory_gb


def verdict(p: Plan, device_memory_gb: float, headroom: float) -> str:
    """ "fits with X GiB to spare" or "does not fit by Y GiB", the reserved peak against the device."""
    spare = gib(device_memory_gb - reserved_gb(p, headroom))
    return f"fits with {spare:.1f} GiB to spare" if spare >= 0 else f"does not fit by {-spare:.1f} GiB"


def host_memory_gb() -> float:
    """This machine's RAM: a CPU "device"'s memory."""

    return host_memory_bytes() / 1e9
