"""planner_accuracy: the planner's activation bytes against what autograd really saves.

A 125m-shaped Llama (transformers, SDPA) runs one forward + loss on the CPU under
`torch.autograd.graph.saved_tensors_hooks`; the measured figure is the bytes of every
distinct storage saved for backward that is not a parameter, plus, with activation
checkpointing, the block inputs the checkpoints hold for their recompute. Under bf16 and fp8
(autocast, as DDP runs them) the saved tensors include autocast's bf16 weight copies, so the
planned figure there adds the recipe's weight copies. The same again for one rank of a
tensor-parallel pair (`train.tp=2`, under torch's fake process group: one process, a rank's
real shards). `ratio` = measured / planned, the worst (farthest from 1) of fp32, bf16 and fp8,
each with and without activation checkpointing, with tp 1 and 2; target [0.9, 1.1].
"""

from __future__ import annotations

import json
import sys

import torch

from benchmarks.common import report
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
    from components.precision import recipe
    from components.train.model import build_model
    from components.train.parallel import ParallelDims, parallelize

    model = build_model(model_cfg, model_cfg.vocab_size, seed=0)
    precision, cpu = recipe(train.precision), torch.device("cpu")
    precision.apply(model, train, cpu)
    return parallelize(model, train, ParallelDims.of(train, train.tp), cpu, precision)


def measured_bytes(model_cfg: ModelConfig, train: TrainConfig, seq_len: int) -> int:
    """Bytes saved for backward by one forward + loss of a freshly built model (with
    `train.tp` > 1: by one tp rank)."""
    from components.precision import recipe
    from components.train.model import transformer_blocks

    model = tp_model(model_cfg, train)
    precision = recipe(train.precision)
    params = {x.untyped_storage().data_ptr() for p in model.parameters() for x in _plain(p)}
    saved: dict[int, int] = {}

    def keep(t: torch.Tensor) -> None:
        for x in _plain(t):
            storage = x.untyped_storage()
            if storage.data_ptr() not in params:
                saved[storage.data_ptr()] = storage.nbytes()

    def pack(t: torch.Tensor) -> torch.Tensor:
        keep(t)
        return t

    def held_for_recompute(module, args, kwargs) -> None:
        keep(kwargs["hidden_states"] if "hidden_states" in kwargs else args[0])

    if train.activation_checkpointing:
        for i, block in enumerate(transformer_blocks(model)):
            if i % train.ac_every_n_blocks == 0:
                block.register_forward_pre_hook(held_for_recompute, with_kwargs=True)
    ids = torch.randint(0, model_cfg.vocab_size, (train.micro_batch_size, seq_len + 1))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with precision.autocast(torch.device("cpu"), fsdp=False):
            logits = model(input_ids=ids[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
    del loss, logits
    return sum(saved.values())


def planned_bytes(model_cfg: ModelConfig, train: TrainConfig, seq_len: int) -> float:
    from components.model_math import param_tensors
    from components.precision import recipe
    from components.preflight.plan import activation_bytes, tp_local, weight_copies

    tensors, layers = tp_local(param_tensors(model_cfg), train.tp), model_cfg.num_layers
    copies = weight_copies(tensors, layers, recipe(train.precision), train, sharded=False, recompute=False)
    return activation_bytes(model_cfg, train, seq_len, recompute=False) + copies


def fake_tp_world(size: int = 2) -> None:
    """One process stands for rank 0 of `size`: torch's fake process group runs no collective,
    so a tp rank's shapes, shards and saved tensors are the real ones (values are not)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)


def main(argv: list[str]) -> None:
    torch.set_num_threads(2)
    model_cfg = defaults("model", name="125m", max_seq_len=2048, **SHAPE_125M)
    seq_len, micro = 512, 2
    rows = {}
    fake_tp_world()
    for tp in (1, 2):
        for precision in (Precision.fp32, Precision.bf16, Precision.fp8):
            for ac in (False, True):
                train = defaults(
                    "train",
                    precision=precision,
                    activation_checkpointing=ac,
                    micro_batch_size=micro,
                    parallelism=Parallelism.ddp,
                    tp=tp,
                )
                measured, planned = measured_bytes(model_cfg, train, seq_len), planned_bytes(model_cfg, train, seq_len)
                key = f"{'tp2_' if tp > 1 else ''}{precision.value}{'_ac' if ac else ''}"
                rows[key] = {"measured_mb": measured / 1e6, "planned_mb": planned / 1e6, "ratio": measured / planned}
                print(json.dumps({key: rows[key]}), flush=True)
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
        **{f"ratio_{k}": round(v["ratio"], 4) for k, v in rows.items()},
    )


if __name__ == "__main__":
    main(sys.argv[1:])
