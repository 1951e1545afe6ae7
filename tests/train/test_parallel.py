"""Data parallelism on real process groups: FSDP2's gradient accumulation, on two gloo ranks."""

from __future__ import annotations

import json

import torch
import torch.multiprocessing as mp

VOCAB, ACCUM, WORLD = 256, 2, 2


def _batch(rank: int, micro: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * rank + micro)
    return torch.randint(0, VOCAB, (2, 17), generator=g)


def _fsdp_accumulation(rank: int, pg_file: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from components.config import defaults
    from components.models import build_model
    from components.parallel import ParallelDims
    from components.parallel.apply import gradient_sync, wrap
    from components.precision import recipe

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{pg_file}", rank=rank, world_size=WORLD)
    found = {}
    for every in (True, False):
        model = build_model(defaults("model", vocab_size=VOCAB), VOCAB, seed=0)
        model = wrap(model, ParallelDims(dp_shard=WORLD), torch.device("cpu"), recipe("fp32"))
        held_after_first = None
        for micro in range(ACCUM):
            with gradient_sync(model, micro == ACCUM - 1, every):
                ids = _batch(rank, micro)
                (model(input_ids=ids, labels=ids).loss / ACCUM).backward()
            if micro == 0:  # what each rank holds as gradients between micro-batches
                grads = [p.grad for p in model.parameters()]
                held_after_first = {
                    "sharded": all(isinstance(g, DTensor) for g in grads),
                    "none": all(g is None for g in grads),
                    "local_numel": sum(g.to_local().numel() for g in grads if isinstance(g, DTensor)),
                }
        full = {n: p.grad.full_tensor().tolist() for n, p in model.named_parameters()}
        found["every" if every else "last"] = {"held": held_after_first, "grads": full}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(found, f)
    dist.destroy_process_group()


def test_fsdp_reduce_scatters_every_micro_batch_by_default_and_both_ways_give_the_reference_gradient(tmp_path):
    """With sync every micro-batch, each rank holds only its gradient shard after the first
    micro-batch (FSDP2 reduce-scattered it); with the sync skipped it holds no sharded gradient
    yet (the unsharded one is FSDP's own). Either way the final gradient is the mean over both
    ranks' micro-batches, computed here by one unwrapped model."""
    from components.config import defaults
    from components.models import build_model

    out = tmp_path / "out.json"
    mp.spawn(_fsdp_accumulation, args=(str(tmp_path / "pg"), str(out)), nprocs=WORLD, join=True)
    found = json.loads(out.read_text())

    reference = build_model(defaults("model", vocab_size=VOCAB), VOCAB, seed=0)
    for rank in range(WORLD):
        for micro in range(ACCUM):
            ids = _batch(rank, micro)
            (reference(input_ids=ids, labels=ids).loss / (ACCUM * WORLD)).backward()
    numel = sum(p.numel() for p in reference.parameters())

    every, last = found["every"]["held"], found["last"]["held"]
    assert every["sharded"] and every["local_numel"] < 0.6 * numel  # rank 0's shard, not the whole
    assert last["none"] and not last["sharded"]
    for mode in ("every", "last"):
        for name, p in reference.named_parameters():
            torch.testing.assert_close(torch.tensor(found[mode]["grads"][name]), p.grad, rtol=1e-4, atol=1e-6)
