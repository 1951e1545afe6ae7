"""validate on launched replicas, for a model whose weights do not fit the KFP pod
(`components/sharded_model.py`): the same checks as in the pod, each rank on its own shards.

- model_hashes: each node's first rank fetches the export and re-hashes every file;
- checkpoint_hashes: the checkpoint's weights, and only those, fetched per node and verified
  block by block (`load_sharded`);
- export_loads_sharded: the export's config builds the model and its tensors are the model's
  (names, shapes, dtypes, from the safetensors headers);
- checkpoint_matches_export: each rank's checkpoint shards equal the same slices of the export
  (read per tensor from the safetensors file, never the whole tensor);
- forward_finite and loss_agrees: the val blocks spread over the ranks, the sums reduced.
A check that fails on any rank fails on all of them alike; rank 0 hands the verdict (or the
failure) back through the store."""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from components.sharded_model import (
    ShardedLoadFailed,
    checkpoint_of,
    collectively,
    dataset_of,
    load_sharded,
    local_numel,
    my_batches,
    run_replica,
    summed,
)
from components.store import ArtifactStore, Manifest, Ref
from components.stream import open_split
from components.validate.checks import ValidationFailed, Verdict, fetch_verified_export, losses_hold, weights_agree
from components.worker_side import exit_now


def fetch_export(store: ArtifactStore, model: Manifest) -> Path:
    """The export on this node, fetched and re-hashed by its first rank."""
    leader = int(os.environ.get("LOCAL_RANK", "0")) == 0

    def fetch() -> None:
        if leader:
            fetch_verified_export(store, model)  # a damaged stored version is quarantined

    collectively(fetch, f"model {model.ref}", ValidationFailed)
    return store.fetch(model)  # a verified copy is there now: the cache's stamp answers


def export_tensors(model_dir: Path) -> dict[str, Path]:
    """Each tensor of the safetensors export, by name, and the file holding it."""
    from safetensors import safe_open

    found = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            found.update(dict.fromkeys(f.keys(), path))
    return found


def compare_shards(model: torch.nn.Module, model_dir: Path) -> tuple[list[str], dict[str, float]]:
    """(this rank's problems with the export's names, shapes and dtypes; the max |diff| of each
    tensor whose local shard differs from the same slice of the export)."""
    from safetensors import safe_open
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    where = export_tensors(model_dir)
    params = dict(model.named_parameters())  # tied weights once, as the export saves them
    problems = [f"{n}: in the export, not in the model" for n in sorted(set(where) - set(params))]
    problems += [f"{n}: in the model, not in the export" for n in sorted(set(params) - set(where))]
    differ = {}
    for name in sorted(set(where) & set(params)):
        p = params[name]
        with safe_open(str(where[name]), framework="pt") as f:
            stored = f.get_slice(name)
            shape, dtype = tuple(stored.get_shape()), stored.get_dtype()
            if shape != tuple(p.shape) or dtype != "F32":
                problems.append(f"{name}: export {dtype} {list(shape)}, model float32 {list(p.shape)}")
                continue
            local = p.to_local() if hasattr(p, "to_local") else p.data
            if local.numel() == 0:
                continue
            size, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            rows = stored[offset[0] : offset[0] + size[0]]  # FSDP2 shards dim 0: one read of its rows
        if not torch.equal(local.detach().cpu(), rows):
            differ[name] = float((local.detach().cpu().float() - rows.float()).abs().max())
    return problems, differ


def gathered(value) -> list:
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def sharded_mean_loss(model, blocks, n_blocks: int, batch_size: int, device) -> tuple[float, bool]:
    """validate's mean_loss, the batches spread over the ranks."""

    @torch.no_grad()
    def nats(batch):
        logits = model(input_ids=batch[:, :-1].to(device)).logits.float()
        loss = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), batch[:, 1:].to(device).flatten(), reduction="sum"
        )
        return float(loss), batch[:, 1:].numel(), bool(torch.isfinite(logits).all())

    parts = my_batches(blocks, n_blocks, batch_size, nats)
    total, count, bad = summed(device, sum(p[0] for p in parts), sum(p[1] for p in parts),
                               sum(not p[2] for p in parts))  # fmt: skip
    return (total / count if count else math.nan), bad == 0


def sharded_validate(store: ArtifactStore, model_ref: str, cfg, device: torch.device) -> tuple[Verdict, int]:
    """The verdict, and the parameter elements this rank held."""
    verdict = Verdict()
    manifest = collectively(lambda: store.manifest(Ref.parse(model_ref)), f"model {model_ref}", ValidationFailed)
    ckpt_ref, data_ref = checkpoint_of(manifest), dataset_of(manifest)
    if ckpt_ref is None or data_ref is None:
        raise ValidationFailed(f"{model_ref}: its lineage names no checkpoint or dataset ({manifest.parents})")
    model_dir = fetch_export(store, manifest)
    verdict.passed("model_hashes", model_files=len(manifest.files))
    try:
        model = load_sharded(store, manifest, device, store.cache_dir)
    except ShardedLoadFailed as e:
        raise ValidationFailed(str(e)) from None
    held = local_numel(model)  # loaded: its shards (the root's are gathered by the first forward and kept)
    verdict.passed("checkpoint_hashes", replicas=dist.get_world_size())
    problems, differ = collectively(lambda: compare_shards(model, model_dir), f"model {model_ref}", ValidationFailed)
    problems = sorted({p for rank in gathered(problems) for p in rank})
    if problems:
        raise ValidationFailed(f"model {model_ref}: its export is not the model: {'; '.join(problems[:3])}")
    verdict.passed("export_loads_sharded", parameters=sum(p.numel() for p in model.parameters()))
    weights_agree(verdict, {k: v for rank in gathered(differ) for k, v in rank.items()}, ckpt_ref, model_ref)
    val = collectively(lambda: open_split(store, store.manifest(Ref.parse(data_ref)), "val"), f"dataset {data_ref}",
                       ValidationFailed)  # fmt: skip
    losses_hold(verdict, lambda n, size: sharded_mean_loss(model, val, n, size, device), val, data_ref, manifest, cfg)
    val.close()
    return verdict, held


def validate_here(spec, store: ArtifactStore, rank: int, device: torch.device) -> dict:
    """This rank's part of validate; the verdict with each rank's share of the parameters."""
    verdict, held = sharded_validate(store, spec.models[0], spec.eval, device)
    held = gathered(held)  # what each rank's memory held of the weights: its shards
    return {"checks": verdict.checks, "numbers": {**verdict.numbers, "rank_params_max": max(held),
                                                  "rank_params_sum": sum(held)}}  # fmt: skip


@record
def main(argv: list[str] | None = None) -> int:
    return run_replica(argv, validate_here, ValidationFailed)


if __name__ == "__main__":
    exit_now(main())
