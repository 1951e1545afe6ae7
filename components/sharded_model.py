"""A trained model on launched replicas, for the stages that judge it (validate, evaluate) when
its weights do not fit the KFP pod: the model is built on the meta device from its export's
`config.json`, sharded with FSDP2 over every launched rank, and loaded from its checkpoint's
weights only (each node fetches the blocks its ranks' shards read, verified; never a byte of
the optimizer state). The driver's side (`launch_replicas`) launches a stage's worker through
the same TorchX launcher as train and reads back what rank 0 published; `in_pod` says which
way a model goes."""

from __future__ import annotations

import json
import logging
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from components.checkpoint_fetch import everyone, fetch_for_node, read_ranges
from components.checkpoint_format import MODEL_KEY, CheckpointError, load_state
from components.config import ClusterConfig, EvalConfig, StoreConfig
from components.models import spec_of
from components.store import ArtifactStore, IntegrityError, Manifest, Ref, StoreError
from components.summaries import gib
from components.worker_side import WorkerSpec

log = logging.getLogger(__name__)

REPLICA_TIMEOUT_S = 3600.0  # a collective's wait: rank 0 counting the unigram baseline, a node fetching an export

# validate holds two fp32 copies of the weights in its pod (the export it loads, the checkpoint's
# to compare), evaluate one and a baseline's; the third is the headroom (activations, logits, the
# unigram counts): the pod is used while it holds POD_COPIES of them
POD_COPIES = 3


def export_bytes(manifest: Manifest) -> int:
    """The model's fp32 weights: its safetensors export (train exports fp32) as the manifest lists it."""
    return sum(e["size"] for rel, e in manifest.files.items() if rel.endswith(".safetensors"))


def in_pod(cfg: EvalConfig, manifest: Manifest, pod_memory_gb: float) -> bool:
    """Whether the stage loads the model in its own KFP pod (`eval.launch`: pod | replicas |
    auto: in the pod while its memory holds POD_COPIES of the fp32 weights)."""
    return fits_pod(cfg.launch, export_bytes(manifest), pod_memory_gb)


def fits_pod(launch: str, weight_bytes: float, pod_memory_gb: float) -> bool:
    if launch != "auto":
        return launch == "pod"
    return POD_COPIES * weight_bytes <= pod_memory_gb * 1e9


def eval_plan(cfg, params: int, root_params: int, device_memory_gb: float) -> tuple[str, bool]:
    """Where validate and evaluate will load a model of `params` parameters (`root_params` of
    them the embeddings, head and final norm, which FSDP2 keeps gathered after the first
    forward) and what a device holds there: (the plan's line, whether it fits)."""
    weights, ev = params * 4, cfg.eval
    if fits_pod(ev.launch, weights, cfg.kfp.eval_memory_gb):
        pod_gib = gib(cfg.kfp.eval_memory_gb)
        return (f"in their KFP pod: {POD_COPIES} x {weights / 2**30:.3g} GiB of fp32 weights within "
                f"kfp.eval_memory_gb={cfg.kfp.eval_memory_gb:g} ({pod_gib:.3g} GiB)"), True  # fmt: skip
    world = cfg.cluster.nodes * cfg.cluster.procs_per_node
    vocab = cfg.model.vocab_size or cfg.tokenizer.vocab_size
    shards = (weights - root_params * 4) / world + root_params * 4
    logits = 2 * ev.batch_size * cfg.data.seq_len * vocab * 4  # a batch's fp32 logits and their loss
    need = (shards + logits) / 1e9
    line = (f"on {world} launched ranks (eval.launch={ev.launch}): {shards / 2**30:.2f} GiB of fp32 weights per "
            f"device (its shards, the embeddings and head whole) + {logits / 2**30:.2f} GiB of logits "
            f"(eval.batch_size={ev.batch_size}) = {gib(need):.2f} GiB of {gib(device_memory_gb):.1f} GiB"
            )  # fmt: skip
    return line, need <= device_memory_gb


def export_head(store: ArtifactStore, manifest: Manifest) -> Path:
    """The export's files but its weights (config, tokenizer, training curves), verified, where
    a whole fetch would put them: what a driver reads of a model it does not load."""
    dest = store.cache_dir / manifest.ref.prefix
    for rel in manifest.files:
        if not rel.endswith(".safetensors"):
            store.fetch_file(manifest, rel, dest / rel)
    return dest


def checkpoint_of(manifest: Manifest) -> str | None:
    return next((p for p in manifest.parents if p.startswith("checkpoint/")), None)


def dataset_of(manifest: Manifest) -> str | None:
    return next((p for p in manifest.parents if p.startswith("dataset/")), None)


@dataclass(frozen=True)
class ReplicaSpec(WorkerSpec):
    """What validate or evaluate tells its replicas."""

    eval: EvalConfig
    store: StoreConfig  # as the replicas reach it (launcher.replica_store)
    models: list  # model/NAME@VERSION, measured in turn (evaluate: the model, then its baseline)
    dataset: str  # dataset/NAME@VERSION: the first model's, which every model is measured on
    run: str  # the hand-back: run/<run>@<launch_id>, published by rank 0
    launch_id: str


def launch_replicas(module: str, stage: str, cfg: EvalConfig, models: list[str], cluster: ClusterConfig,
                    store_cfg: StoreConfig, store: ArtifactStore) -> dict:  # fmt: skip
    """Run `module` (a stage's worker) on the cluster's nodes; what its rank 0 handed back."""
    from components import fleet
    from components.launcher import Launch, replica_store, run_app

    launch_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}"
    run = f"{stage}-{Ref.parse(models[0]).name}"
    dataset = dataset_of(store.manifest(Ref.parse(models[0]))) or ""
    spec = ReplicaSpec(cfg, replica_store(store_cfg, cluster), list(models), dataset, run, launch_id)
    where = Path(f"{stage}-replicas").resolve() / launch_id  # the task's own directory (its pod's disk)
    launch = Launch(module, spec, cluster, f"{stage}-{launch_id[-8:]}", where / "logs", where / "nodes")
    launch.quarantined = lambda: fleet.quarantined(store)
    log.info("%s: %s on %d node(s) x %d", stage, models[0], cluster.nodes, cluster.procs_per_node)
    run_app(launch)
    record = store.fetch(store.manifest(Ref("run", run, launch_id)))  # the store: the only way back
    return json.loads((record / "result.json").read_text())


def run_replica(argv: list[str] | None, work, failed: type[Exception]) -> int:
    """A stage worker's life on one rank: its spec, the process group and the store; then
    `work(spec, store, rank, device)`, the result rank 0 publishes where the driver reads it
    (`{"failed": why}` when `work` raised `failed`, which it raises on every rank alike)."""
    import torch.distributed as dist

    from components.distributed import init_distributed
    from components.store import open_store
    from components.worker_side import worker_spec

    spec = worker_spec(argv, ReplicaSpec)
    rank, _, device = init_distributed(timeout_s=REPLICA_TIMEOUT_S)
    store = open_store(spec.store)
    try:
        result = work(spec, store, rank, device)
    except failed as e:
        result = {"failed": str(e)}
    if rank == 0:
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "result.json").write_text(json.dumps(result, indent=2))
            store.publish("run", spec.run, spec.launch_id, Path(tmp), parents=spec.models)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def collectively(step, what: str, failed: type[Exception]):
    """`step` on this rank; any rank's failure raised on every rank alike: the store's as
    StoreError (not the model's fault), anything else as `failed` naming `what`."""
    result, failures = everyone(step)
    if failures:
        kind, why = failures[0]
        raise (StoreError if kind == "store" else failed)(f"{what}: {why}")
    return result


class ShardedLoadFailed(RuntimeError):
    """The checkpoint's weights could not be loaded: its bytes or its shapes (every rank says so)."""


def build_sharded(config_dir: Path, device: torch.device) -> torch.nn.Module:
    """The export's architecture, its parameters never materialized whole: built on the meta
    device, each decoder block and the root sharded with FSDP2 over every rank, then allocated."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(config_dir))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    spec = spec_of(model)
    for block in spec.blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device=device)
    # its only buffers (Llama: the rotary frequencies) are not saved: computed again, not left empty
    spec.rebuild_buffers(model, config, device)
    stray = [n for n, _ in model.named_buffers() if not n.startswith(spec.buffer_prefix)]
    if stray:
        raise ShardedLoadFailed(f"{type(model).__name__}: buffers not in the checkpoint: {stray[:3]}")
    return model.eval()


def load_sharded(store: ArtifactStore, model: Manifest, device: torch.device, root: Path):
    """The model sharded over every rank with its checkpoint's weights. A collective.
    ShardedLoadFailed names the checkpoint and what does not verify or fit, on every rank alike;
    a store failure raises StoreError."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    ckpt_ref = checkpoint_of(model)
    if ckpt_ref is None:
        raise ShardedLoadFailed(f"{model.ref}: its lineage names no checkpoint")
    config = collectively(lambda: store.fetch_file(model, "config.json", config_path(root, model)), str(model.ref),
                          ShardedLoadFailed)  # fmt: skip
    sharded = build_sharded(config.parent, device)
    weights = get_model_state_dict(sharded)  # this rank's shards (DTensors)
    ckpt = Ref.parse(ckpt_ref)
    path, failures = fetch_for_node(store, root / ckpt.prefix, ckpt, lambda p: read_ranges({MODEL_KEY: weights}, p))
    if failures:
        kind, why = failures[0]
        if kind == "store":
            raise StoreError(f"checkpoint {ckpt_ref}: {why}")
        raise ShardedLoadFailed(f"checkpoint {ckpt_ref}: {why}")
    try:
        load_state({MODEL_KEY: weights}, path)
    except (CheckpointError, IntegrityError) as e:
        raise ShardedLoadFailed(f"checkpoint {ckpt_ref}: the weights do not load into the model: {e}") from None
    set_model_state_dict(sharded, weights)
    return sharded


def config_path(root: Path, model: Manifest) -> Path:
    """Where a node keeps a model's export config.json (the export's weights are not fetched)."""
    return root / model.ref.prefix / "config.json"


def local_numel(model: torch.nn.Module) -> int:
    """The parameter elements this rank holds (its shards)."""
    return sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())


def my_batches(blocks, n_blocks: int, batch_size: int, fn) -> list:
    """`fn(batch)` on this rank's share of the first `n_blocks` blocks in batches of
    `batch_size` (batch j on rank j % world, the batches `blocks.batches` makes), the results in
    batch order. Every rank runs as many forwards (a sharded model's forward is a collective):
    a rank past its share runs the first batch again and its result is dropped."""
    import numpy as np
    import torch.distributed as dist

    from components.blocks import first_blocks

    def batch(j: int) -> torch.Tensor:
        rows = range(j * batch_size, min(n, (j + 1) * batch_size))
        return torch.from_numpy(np.stack([blocks[i] for i in rows]).astype(np.int64))

    rank, world, n = dist.get_rank(), dist.get_world_size(), first_blocks(blocks, n_blocks)
    count = -(-n // batch_size)
    out = []
    for first in range(0, count, world):
        mine = first + rank < count
        result = fn(batch(first + rank if mine else 0))
        out += [result] if mine else []
    return out


def summed(device: torch.device, *values: float) -> list[float]:
    """Each value summed over every rank, in float64 (on the device: NCCL reduces GPU tensors)."""
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()
