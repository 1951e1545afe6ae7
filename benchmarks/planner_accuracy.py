"""planner_accuracy: the planner's activation bytes against what autograd really saves.

A 125m-shaped Llama (transformers, SDPA) runs one forward + loss on the CPU under
`torch.autograd.graph.saved_tensors_hooks`; the measured figure is the bytes of every
distinct storage saved for backward that is not a parameter, plus, with activation
checkpointing, the block inputs the checkpoints hold for their recompute. Under bf16 and fp8
(autocast, as DDP runs them) the saved tensors include autocast's bf16 weight copies, so the
planned figure there adds the recipe's weight copies. The same again for one rank of a
tensor-parallel pair (`train.tp=2`, under torch's fake process group: one process, a rank's
real shards). `ratio` = measured / planned, the worst (farthest from 1) of fp32, bf16 and fp8,
each with activation checkpointing off, full and selective (the per-op policy's kept outputs
read from its own cache), with tp 1 and 2; target [0.9, 1.1].

Pipeline parallelism (`train.pp=2`, rows `pp2_<schedule>_rank<r>`): two real ranks under
torchrun (gloo) run one optimizer step of 4 micro-batches through torch's schedule (1F1B,
interleaved 1F1B, GPipe) on a 4-block model of the 125m width; each rank counts the bytes its
saved-for-backward tensors hold while they live (a storage counted once, released when autograd
drops the last tensor saved on it) and keeps the peak: its stage-micro-batches in flight as
the schedule really orders them. Planned: `pipeline_activations` for that rank. fp32, without
activation checkpointing (its checkpoint holds the block inputs outside the saved-tensor hooks).
The second step is measured: torch's first step also infers the stages' shapes, and the first
stage then holds 1.35x (a one-time cost the plan does not count).
"""

from __future__ import annotations

import functools
import itertools
import json
import sys

import torch

from benchmarks.common import report
from components.config import ActivationCheckpointing as AC
from components.config import ModelConfig, Parallelism, Precision, TrainConfig, defaults

SHAPE_125M = dict(vocab_size=32000, hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=12, ffn_hidden_size=2048)


def _plain(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors behind a DTensor (its local shard) or a tensor subclass (torchao's
    Float8TrainingTensor: its fp8 data and scale)."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return _plain(t.to_local())
    if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter and hasattr(t, "__tensor_flatten__"):
        return [x for name in t.__tensor_flatten__()[0] for x in _plain(getattr(t, name))]
    return [t]


def tp_model(model_cfg: ModelConfig, train: TrainConfig):
    """A freshly built model as the worker builds one rank's (precision conversion, then
    `parallelize`: TP over `train.tp` ranks of the initialised process group, a fake one
    measuring a rank's share in one process, and activation checkpointing)."""
    from components.models import build_model
    from components.parallel import ParallelDims
    from components.parallel.apply import parallelize
    from components.precision import recipe

    model = build_model(model_cfg, model_cfg.vocab_size, seed=0)
    precision, cpu = recipe(train.precision), torch.device("cpu")
    precision.apply(model, train, cpu)
    return parallelize(model, train, ParallelDims.of(train, world_of(train)), cpu, precision)


def world_of(train: TrainConfig) -> int:
    """The ranks a measured rank stands among: its tp group, twice over under FSDP (FSDP2 over
    a data-parallel pair, its mixed-precision policy casting the gathered parameters)."""
    return train.tp * (2 if train.parallelism == Parallelism.fsdp else 1)


def measured_bytes(model_cfg: ModelConfig, train: TrainConfig, seq_len: int) -> int:
    """Bytes saved for backward by one forward + loss of a freshly built model (with
    `train.tp` > 1: by one tp rank)."""
    from components.models import token_loss, transformer_blocks
    from components.parallel.tensor import loss_scope
    from components.precision import recipe

    model = tp_model(model_cfg, train)
    precision, fsdp = recipe(train.precision), train.parallelism == Parallelism.fsdp
    params = {x.untyped_storage().data_ptr() for p in model.parameters() for x in _plain(p)}
    saved: dict[int, int] = {}

    def keep(t: torch.Tensor) -> None:
        # under FSDP a block's parameters are its gathered (unsharded) copies while it runs: the
        # plan counts those as weight copies, not activations
        live = {x.untyped_storage().data_ptr() for p in model.parameters() for x in _plain(p)} if fsdp else params
        for x in _plain(t):
            storage = x.untyped_storage()
            if storage.data_ptr() not in params and storage.data_ptr() not in live:
                saved[storage.data_ptr()] = storage.nbytes()

    def pack(t: torch.Tensor) -> torch.Tensor:
        keep(t)
        return t

    def held_for_recompute(module, args, kwargs) -> None:
        keep(kwargs["hidden_states"] if "hidden_states" in kwargs else args[0])

    def selective_saves(context_fn):  # what the per-op policy keeps: the forward's cache of op outputs
        def counted():
            caching, cached = context_fn()
            kept.append(caching.storage)
            return caching, cached

        return counted

    kept: list[dict] = []
    for i, block in enumerate(transformer_blocks(model)):
        if train.activation_checkpointing == AC.selective or (
            train.activation_checkpointing and i % train.ac_every_n_blocks == 0
        ):
            block.register_forward_pre_hook(held_for_recompute, with_kwargs=True)
        if "context_fn" in getattr(getattr(block, "checkpoint_fn", None), "keywords", {}):  # the per-op policy
            fn = block.checkpoint_fn
            block.checkpoint_fn = functools.partial(
                fn.func, *fn.args, **{**fn.keywords, "context_fn": selective_saves(fn.keywords["context_fn"])}
            )
    ids = torch.randint(0, model_cfg.vocab_size, (train.micro_batch_size, seq_len + 1))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), loss_scope(model):
        with precision.autocast(torch.device("cpu"), fsdp=fsdp):
            logits = model(input_ids=ids[:, :-1]).logits
        loss = token_loss(logits, ids[:, 1:], train.loss_chunk_tokens)  # under sequence parallel the loss-parallel one
    for storage in kept:  # {op: {call index: its outputs, each wrapped (`.val`), or a recompute mark}}
        for calls in storage.values():
            for outputs in calls.values():
                for leaf in torch.utils._pytree.tree_leaves(outputs):
                    if isinstance(getattr(leaf, "val", None), torch.Tensor):
                        keep(leaf.val)
    del loss, logits
    return sum(saved.values())


def planned_bytes(model_cfg: ModelConfig, train: TrainConfig, seq_len: int, peak: bool = False) -> float:
    """What `measured_bytes` counts, as planned: the saved activations plus, outside FSDP (whose
    gathered copies are not counted as saved), autocast's weight copies. `peak`: what
    `peak_bytes` counts, the activations at their peak (the loss's transient, or a block's
    recompute with its copies)."""
    from components.model_math import param_tensors
    from components.parallel import sequence_parallel
    from components.precision import recipe
    from components.preflight.plan import activation_bytes, tp_local, weight_copies

    sp = sequence_parallel(train, model_cfg.tie_embeddings, cuda=False)  # as `tp_model` builds it here
    tensors, layers = tp_local(param_tensors(model_cfg), train.tp, sp), model_cfg.num_layers
    fsdp, precision = train.parallelism == Parallelism.fsdp, recipe(train.precision)
    kept = 0.0 if fsdp else weight_copies(tensors, layers, precision, train, False, recompute=False)
    extra = weight_copies(tensors, layers, precision, train, False) - kept if peak and not fsdp else 0.0
    return activation_bytes(model_cfg, train, seq_len, recompute=peak, sp=sp, fsdp=fsdp, recompute_extra=extra) + kept


def fake_tp_world(size: int = 2) -> None:
    """One process stands for rank 0 of `size`: torch's fake process group runs no collective,
    so a tp rank's shapes, shards and saved tensors are the real ones (values are not)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)


SHAPE_PP = {**SHAPE_125M, "vocab_size": 8000, "num_layers": 4}  # 4 blocks: 2 a rank, 1 a stage interleaved
PP_SEQ, PP_MICRO, PP_STEPS = 256, 2, 4


class _Held:
    """A tensor saved for backward, counted in `live` while autograd keeps it."""

    def __init__(self, t: torch.Tensor, storages: list[tuple[int, int]], counter: dict):
        self.t, self.storages, self.counter = t, storages, counter
        for ptr, nbytes in storages:
            refs = counter["refs"]
            refs[ptr] = refs.get(ptr, 0) + 1
            counter["live"] += nbytes if refs[ptr] == 1 else 0
        counter["peak"] = max(counter["peak"], counter["live"])

    def __del__(self):
        for ptr, nbytes in self.storages:
            self.counter["refs"][ptr] -= 1
            if self.counter["refs"][ptr] == 0:
                del self.counter["refs"][ptr]
                self.counter["live"] -= nbytes


def pp_rank_peak(schedule: str, out: str) -> None:
    """(one of 2 torchrun ranks) this rank's peak saved-for-backward bytes over one step of
    `schedule`, and the planner's figure for it, into `out`.<rank>.json."""
    import torch.distributed as dist

    from components.models import build_model
    from components.parallel import ParallelDims
    from components.parallel.apply import parallelize
    from components.parallel.pipeline import Pipeline
    from components.precision import recipe
    from components.preflight.plan import pipeline_activations, pipeline_shares

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model_cfg = defaults("model", name="125m", max_seq_len=2048, **SHAPE_PP)
    train = defaults("train", precision=Precision.fp32, activation_checkpointing=AC.off, micro_batch_size=PP_MICRO,
                     grad_accum_steps=PP_STEPS, pp=2, pp_schedule=schedule, parallelism=Parallelism.ddp)  # fmt: skip
    cpu, precision = torch.device("cpu"), recipe(train.precision)
    model = parallelize(build_model(model_cfg, model_cfg.vocab_size, seed=0), train, ParallelDims.of(train, 2), cpu,
                        precision)  # fmt: skip
    pipe = Pipeline.of(model, train, cpu)
    params = {x.untyped_storage().data_ptr() for p in model.parameters() for x in _plain(p)}
    counter = {"refs": {}, "live": 0, "peak": 0}

    def pack(t: torch.Tensor) -> _Held:
        kept = [(x.untyped_storage().data_ptr(), x.untyped_storage().nbytes()) for x in _plain(t)]
        return _Held(t, [k for k in kept if k[0] not in params], counter)

    batch = torch.randint(0, model_cfg.vocab_size, (PP_MICRO * PP_STEPS, PP_SEQ + 1))
    pipe.step(batch)  # the first step also infers the stages' shapes: the second is every later one
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda held: held.t):
        pipe.step(batch)
    share = next(s for s in pipeline_shares(model_cfg, train) if s.rank == rank)
    planned = pipeline_activations(model_cfg, train, PP_SEQ, share, loss=False)  # saved tensors: no transient
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump({"measured": counter["peak"], "planned": planned}, f)
    dist.destroy_process_group()


def pp_rows(schedules=("1f1b", "interleaved_1f1b", "gpipe")) -> dict:
    """Each schedule's two ranks, measured under torchrun."""
    import os
    import subprocess
    import tempfile
    from pathlib import Path

    rows = {}
    for schedule in schedules:
        with tempfile.TemporaryDirectory() as tmp:
            out = f"{tmp}/peak"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                   "-m", "benchmarks.planner_accuracy", "--pp-rank", schedule, out]  # fmt: skip
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            subprocess.run(cmd, check=True, env=env, cwd=Path(__file__).parent.parent, stdout=subprocess.DEVNULL,
                           timeout=600)  # fmt: skip
            for rank in (0, 1):
                got = json.loads(Path(f"{out}.{rank}.json").read_text())
                key = f"pp2_{schedule}_rank{rank}"
                rows[key] = {"measured_mb": got["measured"] / 1e6, "planned_mb": got["planned"] / 1e6,
                             "ratio": got["measured"] / got["planned"]}  # fmt: skip
                print(json.dumps({key: rows[key]}), flush=True)
    return rows


SEQ, MICRO = 512, 2


def peak_bytes(model_cfg: ModelConfig, train: TrainConfig, seq_len: int, grads: bool = False) -> int:
    """The peak bytes live during one forward + loss + backward of a freshly built model (one tp
    rank of `train.tp`), less the parameters and their gradients, as torch's own MemTracker
    (torch.distributed._tools.mem_tracker: every tensor's storage, by a dispatch mode) counts
    them: what activations, autocast's copies and the loss's transients hold at once."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from components.models import token_loss
    from components.parallel.tensor import loss_scope
    from components.precision import recipe

    model = tp_model(model_cfg, train)
    fsdp = train.parallelism == Parallelism.fsdp
    ids = torch.randint(0, model_cfg.vocab_size, (train.micro_batch_size, seq_len + 1))
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker, loss_scope(model):
        with recipe(train.precision).autocast(torch.device("cpu"), fsdp=fsdp):
            logits = model(input_ids=ids[:, :-1]).logits
        loss = token_loss(logits, ids[:, 1:], train.loss_chunk_tokens)
        del logits  # as the trainer drops its output before backward
        loss.backward()
    (peak,) = tracker.get_tracker_snapshot("peak").values()
    kinds = ("ACT", "TEMP", "OTH", "GRAD") if grads else ("ACT", "TEMP", "OTH")
    return sum(n for kind, n in peak.items() if getattr(kind, "name", kind) in kinds)


def step_peak(model_cfg: ModelConfig, train: TrainConfig, seq_len: int) -> tuple[int, float]:
    """(measured, planned) bytes at one process's peak beside its weights: activations, the
    loss's transients and the gradients filled in by then (`peak_bytes` with grads), against
    the plan's total less its weights and AdamW state (one process: the larger of the
    gradients and the activations, which backward frees as the gradients fill in)."""
    from components.preflight.plan import plan

    p = plan(model_cfg, train, 1, seq_len, cuda=False)
    return peak_bytes(model_cfg, train, seq_len, grads=True), (p.total_gb - p.weights_gb - p.optimizer_gb) * 1e9


def planned_peak(model_cfg: ModelConfig, train: TrainConfig, seq_len: int) -> float:
    return planned_bytes(model_cfg, train, seq_len, peak=True)


def peak_row(tp: int, precision: str, ac: str, parallelism: str) -> dict:
    """One layout's activations at their peak against the plan, the loss whole (the peak is its
    transient, before any gradient exists)."""
    torch.set_num_threads(2)
    train = defaults("train", precision=Precision(precision), activation_checkpointing=AC(ac), micro_batch_size=MICRO,
                     parallelism=Parallelism(parallelism), tp=tp, loss_chunk_tokens=0)  # fmt: skip
    fake_tp_world(world_of(train))
    model_cfg = defaults("model", name="125m", max_seq_len=2048, **SHAPE_125M)
    measured, planned = peak_bytes(model_cfg, train, SEQ), planned_peak(model_cfg, train, SEQ)
    return {"measured_mb": measured / 1e6, "planned_mb": planned / 1e6, "ratio": measured / planned}


def step_row(precision: str, ac: str, chunk: str) -> dict:
    """One process's whole step (`step_peak`), the loss in chunks of `chunk` tokens (0: whole)."""
    torch.set_num_threads(2)
    train = defaults("train", precision=Precision(precision), activation_checkpointing=AC(ac), micro_batch_size=MICRO,
                     parallelism=Parallelism.ddp, loss_chunk_tokens=int(chunk))  # fmt: skip
    model_cfg = defaults("model", name="125m", max_seq_len=2048, **SHAPE_125M)
    measured, planned = step_peak(model_cfg, train, SEQ)
    return {"measured_mb": measured / 1e6, "planned_mb": planned / 1e6, "ratio": measured / planned}


# layouts whose peak is the loss's transient, before any gradient exists (one process under full
# checkpointing peaks late in backward, its gradients filled in: STEP_ROWS measures that whole)
PEAK_ROWS = [(1, "fp32", "off", "ddp"), (1, "bf16", "off", "fsdp"), (1, "bf16", "selective", "fsdp"),
             (2, "bf16", "off", "ddp"), (2, "bf16", "full", "fsdp")]  # fmt: skip
# one process's whole step in bf16, the loss whole and in chunks of 256 tokens: issue 40's before and after
STEP_ROWS = [("bf16", "off", "0"), ("bf16", "off", "256"), ("bf16", "full", "0"), ("bf16", "full", "256")]


def saved_row(tp: int, precision: str, ac: str, parallelism: str = "ddp") -> dict:
    """One row, measured in this process (a fresh one per row: each row's model leaves ~1 GB
    the process does not give back, and 36 rows would not fit in one)."""
    torch.set_num_threads(2)
    train = defaults("train", precision=Precision(precision), activation_checkpointing=AC(ac), micro_batch_size=MICRO,
                     parallelism=Parallelism(parallelism), tp=tp)  # fmt: skip
    fake_tp_world(world_of(train))
    model_cfg = defaults("model", name="125m", max_seq_len=2048, **SHAPE_125M)
    measured, planned = measured_bytes(model_cfg, train, SEQ), planned_bytes(model_cfg, train, SEQ)
    return {"measured_mb": measured / 1e6, "planned_mb": planned / 1e6, "ratio": measured / planned}


def saved_rows() -> dict:
    """Every precision x checkpointing policy, with tp 1 and 2, under DDP's autocast and FSDP's
    mixed-precision policy, each row in its own process."""
    import subprocess
    from pathlib import Path

    rows = {}
    for parallelism, tp, precision, ac in itertools.product(("ddp", "fsdp"), (1, 2), Precision, AC):
        cmd = [sys.executable, "-m", "benchmarks.planner_accuracy", "--row", str(tp), precision.value, ac.value,
               parallelism]  # fmt: skip
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=Path(__file__).parent.parent,
                             timeout=600)  # fmt: skip
        key = f"{'fsdp_' if parallelism == 'fsdp' else ''}{'tp2_' if tp > 1 else ''}{precision.value}"
        key += f"{'_' + ac.value if ac else ''}"
        rows[key] = json.loads(out.stdout.strip().splitlines()[-1])
        print(json.dumps({key: rows[key]}), flush=True)
    return rows


def peak_rows() -> dict:
    """Peak live bytes (MemTracker) against the plan, a few layouts, each in its own process."""
    import subprocess
    from pathlib import Path

    rows = {}
    for tp, precision, ac, parallelism in PEAK_ROWS:
        cmd = [sys.executable, "-m", "benchmarks.planner_accuracy", "--peak", str(tp), precision, ac, parallelism]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=Path(__file__).parent.parent,
                             timeout=600)  # fmt: skip
        key = f"peak_{parallelism}_{'tp2_' if tp > 1 else ''}{precision}_{ac}"
        rows[key] = json.loads(out.stdout.strip().splitlines()[-1])
        print(json.dumps({key: rows[key]}), flush=True)
    for precision, ac, chunk in STEP_ROWS:
        cmd = [sys.executable, "-m", "benchmarks.planner_accuracy", "--step", precision, ac, chunk]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=Path(__file__).parent.parent,
                             timeout=600)  # fmt: skip
        key = f"step_{precision}_{ac}_loss_chunk{chunk}"
        rows[key] = json.loads(out.stdout.strip().splitlines()[-1])
        print(json.dumps({key: rows[key]}), flush=True)
    return rows


def main(argv: list[str]) -> None:
    if argv[:1] == ["--peak"]:
        return print(json.dumps(peak_row(int(argv[1]), *argv[2:5])))
    if argv[:1] == ["--step"]:  # one process: no process group
        return print(json.dumps(step_row(*argv[1:4])))
    if argv[:1] == ["--pp-rank"]:
        return pp_rank_peak(argv[1], argv[2])
    if argv[:1] == ["--row"]:
        return print(json.dumps(saved_row(int(argv[1]), *argv[2:5])))
    seq_len, micro = SEQ, MICRO
    rows = saved_rows()
    rows.update(peak_rows())
    rows.update(pp_rows())
    worst_key = max(rows, key=lambda k: abs(rows[k]["ratio"] - 1))
    worst = rows[worst_key]
    report(
        "planner_accuracy",
        worst["measured_mb"],
        worst["planned_mb"],
        "MB saved for backward",
        worst_case=worst_key,
        model="125m",
        seq_len=seq_len,
        micro_batch=micro,
        pp_rows=f"4 blocks of the 125m width, vocab 8000, seq {PP_SEQ} x {PP_MICRO}, {PP_STEPS} micro-batches",
        **{f"ratio_{k}": round(v["ratio"], 4) for k, v in rows.items()},
    )


if __name__ == "__main__":
    main(sys.argv[1:])
