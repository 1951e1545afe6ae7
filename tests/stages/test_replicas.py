"""validate and evaluate on launched replicas: a model whose fp32 weights exceed the KFP pod's
memory is loaded sharded over 2 local nodes, from its checkpoint's weights only."""

from __future__ import annotations

import dataclasses
import uuid
from pathlib import Path

import pytest

from components.config import defaults
from components.evaluate.stage import run_evaluate
from components.sharded_model import export_bytes
from components.store import Ref, open_store, sha256_file
from components.validate.checks import ValidationFailed
from components.validate.stage import run_validate
from tests.helpers import TWO_NODES, allocated, s3_trainer, shared_bytes

BLOCK_KIB = 4
EVAL = {"val_blocks": 16, "batch_size": 4, "prompts": ["In the beginning"], "max_new_tokens": 8}


@pytest.fixture(scope="module")
def sharded_run(dataset_store, tmp_path_factory, s3_endpoint):
    """FSDP over 2 nodes, its checkpoint blocks of 4 KiB, in a bucket on the loopback S3 server."""
    mp = pytest.MonkeyPatch()
    for k, v in {"MINIO_ENDPOINT": s3_endpoint, "MINIO_SECURE": "false"}.items():
        mp.setenv(k, v)
    from tests.conftest import S3_ACCESS_KEY, S3_SECRET_KEY

    mp.setenv("MINIO_ACCESS_KEY", S3_ACCESS_KEY)
    mp.setenv("MINIO_SECRET_KEY", S3_SECRET_KEY)
    tmp = tmp_path_factory.mktemp("sharded")
    trainer = s3_trainer(dataset_store, tmp, f"t-{uuid.uuid4().hex[:12]}")
    config = [*TWO_NODES, "train.parallelism=fsdp", "train.steps=10", "train.checkpoint_interval=10"]
    run = trainer.run(*config, f"train.checkpoint_block_kib={BLOCK_KIB}")
    yield trainer, run, trainer.config(*TWO_NODES).cluster
    mp.undo()


def driver_store(trainer, tmp_path: Path):
    """The store as a fresh KFP pod opens it: its own empty cache."""
    cfg = dataclasses.replace(trainer.store_cfg, cache_dir=str(tmp_path / "pod-cache"))
    return cfg, open_store(cfg)


def test_a_model_bigger_than_the_pod_is_validated_and_evaluated_sharded_on_two_nodes_reading_no_optimizer_byte(
    sharded_run, tmp_path, monkeypatch, s3_traffic
):
    """The pod's memory (pod_memory_gb) holds half the fp32 weights: validate and evaluate run
    as 2 launched nodes. Each node holds its own rank's weight file (verified) and of the other
    rank's only the blocks every rank reads: the model was loaded sharded. The S3 server sent no
    byte of the optimizer state and the pod fetched no weight. The verdict and the metrics are
    the in-pod stage's on the same model, though the val batches do not split evenly: 10 blocks
    in batches of 4 are 3 batches (the last of 2 blocks), and rank 1 is past its share in the
    second round (its forward there is only the collective's: its result counts nowhere)."""
    trainer, run, cluster = sharded_run
    monkeypatch.chdir(tmp_path)  # the task's own directory: the replicas' node directories go there
    cfg, store = driver_store(trainer, tmp_path)
    model = store.manifest(run.model.ref)
    pod_gb = export_bytes(model) / 2 / 1e9
    assert export_bytes(model) > pod_gb * 1e9  # the fp32 weights do not fit the pod
    ckpt = store.manifest(Ref.parse(next(p for p in model.parents if p.startswith("checkpoint/"))))
    prefix = f"{cfg.bucket}/{ckpt.ref.prefix}/"
    before = dict(s3_traffic.under(prefix))
    eval_cfg = defaults("eval", **{**EVAL, "val_blocks": 10})

    verdict = run_validate(str(model.ref), eval_cfg, store, cluster, cfg, pod_gb)
    evaluation = run_evaluate(str(model.ref), eval_cfg, store, cluster, cfg, pod_gb)

    after = s3_traffic.under(prefix)
    sent = {n: after.get(prefix + n, 0) - before.get(prefix + n, 0) for n in ckpt.files}
    optimizer = [n for n in ckpt.files if n.endswith("_1.distcp") or n.startswith("rank")]
    assert len(optimizer) == 4 and all(sent[n] == 0 for n in optimizer), sent  # __0_1, __1_1, rank0.pt, rank1.pt
    assert sent["__0_0.distcp"] > 0 and sent["__1_0.distcp"] > 0
    pod = Path(cfg.cache_dir)
    assert not list(pod.rglob("*.safetensors")) and not list(pod.rglob("*.distcp"))  # the pod loaded no weight

    whole = trainer.store.fetch(ckpt, tmp_path / "whole")  # the test's own copy, to read the layout
    for stage in ("validate", "evaluate"):
        (launch,) = (tmp_path / f"{stage}-replicas").iterdir()
        for node, other in ((0, 1), (1, 0)):
            (held,) = (launch / "nodes" / str(node) / "store-cache").rglob("step-10")
            assert sha256_file(held / f"__{node}_0.distcp") == ckpt.files[f"__{node}_0.distcp"]["sha256"]
            theirs = held / f"__{other}_0.distcp"
            most = shared_bytes(whole, theirs.name, BLOCK_KIB * 1024)
            assert allocated(theirs) <= min(most, ckpt.files[theirs.name]["size"] / 2), (stage, theirs)
            assert not list(held.glob("*_1.distcp")) and not list(held.glob("rank*.pt"))

    assert set(verdict.checks) == {
        "model_hashes",
        "checkpoint_hashes",
        "export_loads_sharded",
        "checkpoint_matches_export",
        "forward_finite",
        "loss_agrees",
    }
    total = verdict.numbers["parameters"]
    # each rank's memory held its shards of the weights, never the whole model
    assert verdict.numbers["rank_params_sum"] == total and verdict.numbers["rank_params_max"] <= 0.55 * total
    assert verdict.numbers["loss_gap"] < 1e-4  # the sharded fp32 model's loss is what training measured
    in_pod = run_validate(str(model.ref), eval_cfg, store)
    assert verdict.numbers["val_loss"] == pytest.approx(in_pod.numbers["val_loss"], rel=1e-5)
    reference = run_evaluate(str(model.ref), eval_cfg, store)
    for key in ("val_loss", "val_bits_per_byte", "unigram_perplexity", "val_tokens"):
        assert evaluation.metrics[key] == pytest.approx(reference.metrics[key], rel=1e-5), key
    assert evaluation.samples == reference.samples  # greedy decoding through the sharded model


def test_a_damaged_weight_block_fails_validate_on_replicas_naming_it(sharded_run, tmp_path, monkeypatch):
    """A block of a weight file with other bytes of the same size: the node that reads it fails
    the check on every rank, naming the file and the block, and validate fails."""
    trainer, run, cluster = sharded_run
    monkeypatch.chdir(tmp_path)
    cfg, store = driver_store(trainer, tmp_path)
    model = store.manifest(run.model.ref)
    ckpt = store.manifest(Ref.parse(next(p for p in model.parents if p.startswith("checkpoint/"))))
    key = f"{ckpt.ref.prefix}/__1_0.distcp"
    original = store.backend.get_bytes(key)
    damaged = bytearray(original)
    damaged[len(damaged) // 2] ^= 0xFF
    store.backend.put_bytes(key, bytes(damaged))
    try:
        with pytest.raises(ValidationFailed, match=r"checkpoint .*__1_0\.distcp"):
            run_validate(str(model.ref), defaults("eval", **EVAL), store, cluster, cfg, 1e-6)
    finally:
        store.backend.put_bytes(key, original)


def test_three_ranks_on_one_node_reshard_the_two_rank_checkpoint_and_validate_it(sharded_run, tmp_path, monkeypatch):
    """validate on 1 node x 3 processes: the checkpoint two ranks saved is loaded into uneven
    thirds (64-wide tensors over 3 ranks), the node's first rank fetching for all three; the
    checks hold and no optimizer state is on the node. The val batches outnumber the ranks
    unevenly (4 batches over 3 ranks: ranks 1 and 2 are past their share in the second round;
    the 8 probe blocks are 2 batches: rank 2 has none), and the losses are still the in-pod
    model's and training's."""
    trainer, run, _ = sharded_run
    monkeypatch.chdir(tmp_path)
    cfg, store = driver_store(trainer, tmp_path)
    cluster = trainer.config("cluster.nodes=1", "cluster.procs_per_node=3").cluster
    eval_cfg = defaults("eval", **EVAL)
    verdict = run_validate(str(run.model.ref), eval_cfg, store, cluster, cfg, 1e-6)
    assert verdict.numbers["replicas"] == 3
    in_pod = run_validate(str(run.model.ref), eval_cfg, store)
    assert verdict.numbers["val_loss"] == pytest.approx(in_pod.numbers["val_loss"], rel=1e-5)
    assert verdict.numbers["loss_gap"] < 1e-5  # the probe: what training measured (fp32, on the CPU)
    total = verdict.numbers["parameters"]
    assert verdict.numbers["rank_params_sum"] == total and verdict.numbers["rank_params_max"] <= 0.4 * total
    (held,) = (tmp_path / "validate-replicas").rglob("step-10")
    assert {p.name for p in held.glob("*.distcp")} == {"__0_0.distcp", "__1_0.distcp"}  # both halves, resharded
