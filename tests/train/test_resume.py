"""The store decides what resumes: a node's disk is only a cache of the run's store, a
checkpoint continues only its own schedule unless a seed is named, damage is quarantined."""

from __future__ import annotations

import shutil
import uuid

import pytest
import torch
from safetensors.torch import load_file

from components import checkpoint_format as ckpt
from components.checkpoint_fetch import fetch_reads
from components.config import defaults
from components.store import Ref
from components.train.resume import _decide
from tests.conftest import Trainer
from tests.helpers import TWO_NODES, allocated, s3_trainer, shared_bytes

SHORT = ["train.steps=20", "train.checkpoint_interval=10", "model.hidden_size=32", "model.ffn_hidden_size=96"]


def weights(run) -> dict[str, torch.Tensor]:
    return load_file(run.export / "model.safetensors")


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def stored_steps(trainer, identity) -> dict[int, object]:
    mine = [m for m in trainer.store.versions("checkpoint", "tiny") if m.metadata["identity"] == identity]
    return {m.metadata["step"]: m for m in mine}


def lineage_refs(tree: dict) -> list[str]:
    return [tree["ref"], *(r for p in tree["parents"] for r in lineage_refs(p))]


def test_a_run_against_another_store_trains_from_scratch_there(dataset_store, tmp_path):
    """Store A's run leaves its checkpoints on the node disks; the same config against store B
    (same node disks) must not resume them: B holds nothing of this training, so it trains from
    scratch, publishes its own checkpoints, and its model's lineage is whole in B."""
    a = Trainer(dataset_store, tmp_path / "a")
    b = Trainer(dataset_store, tmp_path / "b")
    b.tmp = a.tmp  # one run directory: the nodes' disks (their checkpoints) are shared between the runs
    first = a.run(*TWO_NODES, *SHORT)
    assert ckpt.local_checkpoints(first.run_dir / "nodes" / "0" / "checkpoints" / first.identity / "node0")
    second = b.run(*TWO_NODES, *SHORT)
    assert second.identity == first.identity and second.result.resumed_from is None
    assert sorted(stored_steps(b, second.identity)) == [10, 20]  # B's run published every checkpoint itself
    for refs in lineage_refs(b.store.lineage(second.model.ref)):
        manifest = b.store.manifest(Ref.parse(refs))  # every version the model was made from is in B
        assert not b.store.verify(manifest.ref), refs
    assert same(weights(first), weights(second))  # the same training, deterministic, from step 0


def test_the_node_copy_is_a_cache_of_the_store(trainer):
    """A damaged local copy of a stored version is repaired from the store; a checkpoint only on
    the node's disk (never committed to the run's store) is never resumed from."""
    r = trainer.run("train.steps=20", "train.checkpoint_interval=10", "train.checkpoint_keep=3")
    root = r.run_dir / "nodes" / "0" / "checkpoints" / r.identity / "node0"
    shard = next((root / "step-20").glob("*.distcp"))
    good = shard.read_bytes()
    shard.write_bytes(good[: len(good) // 2])  # truncated on the node's disk
    cfg = trainer.config("train.steps=20")
    manifest, path = _decide("auto", root, trainer.store, cfg.model, r.identity, max_step=20)
    assert manifest.metadata["step"] == 20 and path == root / "step-20"
    fetch_reads(trainer.store, manifest, path, {shard.name: [(0, len(good))]})  # what a load reads
    assert shard.read_bytes() == good  # fetched back from the store, which holds the good bytes
    other = Trainer(trainer.dataset_store, trainer.tmp / "other")  # a store that never saw this training
    assert _decide("auto", root, other.store, cfg.model, r.identity, max_step=20) is None


def test_a_corrupted_stored_checkpoint_is_quarantined_and_the_rerun_heals_it(trainer):
    """Flip one bit of one shard of the newest stored checkpoint (its size kept), wipe the node
    disks: a launch told preflight was skipped (the store looked finished) refuses to train; the
    rerun resumes from the older step, quarantines the damaged version, trains the same weights and
    publishes the checkpoint again with good bytes; the model's lineage verifies and validate passes."""
    from components.identity import trained_to_the_end
    from components.launcher import LaunchError
    from components.validate.stage import run_validate

    first = trainer.run(*SHORT)
    newest = stored_steps(trainer, first.identity)[20]
    object_file = trainer.tmp / "store" / "checkpoint" / "tiny" / newest.ref.version / "__0_0.distcp"
    flipped = bytearray(object_file.read_bytes())
    flipped[-1] ^= 0x01  # one bit, the size kept: preflight's look (sizes, no bytes) sees it whole and skips
    object_file.write_bytes(bytes(flipped))
    cfg = trainer.config(*SHORT)
    assert trained_to_the_end(trainer.dataset, cfg.model, cfg.train, trainer.store) == str(newest.ref)
    shutil.rmtree(first.run_dir)
    shutil.rmtree(trainer.store_cfg.cache_dir, ignore_errors=True)
    # the launch told that preflight was skipped finds it damaged: it trains no step on an unmeasured fleet
    with pytest.raises(LaunchError, match="preflight was skipped: the store held this training at train.steps=20"):
        trainer.run(*SHORT, "cluster.max_restarts=0", trains_no_step=True)
    shutil.rmtree(trainer.store_cfg.cache_dir, ignore_errors=True)
    again = trainer.run(*SHORT)  # a rerun that measured: resumes from the older step, heals the newest
    assert again.result.resumed_from == str(stored_steps(trainer, first.identity)[10].ref)
    assert again.result.start_step == 10
    assert not trainer.store.exists(newest.ref) and trainer.store.quarantined(newest.ref)  # never resumed again
    healed = stored_steps(trainer, first.identity)[20]
    assert healed.ref != newest.ref and not trainer.store.verify(healed.ref)
    assert same(weights(first), weights(again)) and again.model.ref == first.model.ref  # the same weights
    assert f"checkpoint/tiny@{healed.ref.version}" in again.model.parents  # republished naming the good one
    for refs in lineage_refs(trainer.store.lineage(again.model.ref)):
        assert not trainer.store.verify(Ref.parse(refs)), refs
    verdict = run_validate(str(again.model.ref), defaults("eval"), trainer.store)
    assert verdict.passed
    from components.prelaunch import ResumeError

    with pytest.raises(ResumeError, match=f"{newest.ref} is quarantined: .*__0_0.distcp"):
        trainer.run(*SHORT[1:], "train.steps=30", f"train.resume={newest.ref.version}")


def test_resume_never_over_a_damaged_stored_version_republishes_it(trainer):
    """`train.resume=never` retrains the same weights: the model version it hands back is the
    stored one, whose lineage names a damaged checkpoint; that model is published again naming the
    run's own good checkpoint."""
    first = trainer.run(*SHORT)
    newest = stored_steps(trainer, first.identity)[20]
    object_file = trainer.tmp / "store" / "checkpoint" / "tiny" / newest.ref.version / "__0_0.distcp"
    object_file.write_bytes(b"garbage")
    again = trainer.run(*SHORT, "train.resume=never")
    assert again.result.resumed_from is None
    healed = stored_steps(trainer, first.identity)[20]
    assert not trainer.store.verify(healed.ref) and trainer.store.quarantined(newest.ref)
    assert f"checkpoint/tiny@{healed.ref.version}" in trainer.store.manifest(again.model.ref).parents


@pytest.mark.chaos_slow  # 27 s, three runs: in `make chaos`
def test_a_sweep_job_with_a_shorter_schedule_trains_its_own(trainer):
    """12 steps at lr 1e-3, then the sweep's jobs of 8 steps at lr 1e-3 and 3e-3: each trains its
    own 8 steps from scratch (not the 12-step run's step-8 checkpoint), and a 20-step run seeded
    with the 12-step checkpoint continues it from step 12, naming it in its lineage."""
    base = ["train.checkpoint_interval=4", "train.warmup_steps=2", "model.hidden_size=32", "model.ffn_hidden_size=96"]
    twelve = trainer.run(*base, "train.lr=1e-3", "train.steps=12")
    theirs = stored_steps(trainer, twelve.identity)[8]
    jobs = [trainer.run(*base, f"train.lr={lr}", "train.steps=8") for lr in ("1e-3", "3e-3")]
    from components.plots import read_records

    def lrs(run) -> dict[int, float]:  # the lr each step trained with, as the published model's records say
        return {r["step"]: r["lr"] for r in read_records(run.export / "training_metrics.jsonl")[0]}

    for job in jobs:
        assert job.result.resumed_from is None and job.result.continued == "fresh"
        assert sorted(lrs(job)) == list(range(1, 9))  # it trained its own 8 steps
        assert lrs(job)[8] < lrs(twelve)[8]  # on its own, shorter cosine: lower at step 8 than the 12-step one
        assert job.checkpoint_version != theirs.ref.version
        assert not same(weights(job), weights(twelve))
    seeded = trainer.run(*base, "train.lr=1e-3", "train.steps=20", f"train.resume={twelve.checkpoint_version}")
    assert seeded.result.start_step == 12
    assert seeded.result.continued.startswith(f"resumed from checkpoint/tiny@{twelve.checkpoint_version} at step 12")
    assert trainer.store.manifest(seeded.model.ref).metadata["continued"] == seeded.result.continued
    from components.evaluate.report import identity_rows  # what the eval report's header says

    rows = [identity_rows(trainer.store.manifest(r.model.ref), trainer.dataset, None, "now") for r in (*jobs, seeded)]
    assert [r["started"] for r in rows[:2]] == ["fresh", "fresh"] and rows[2]["started"] == seeded.result.continued
    assert f"checkpoint/tiny@{twelve.checkpoint_version}" in lineage_refs(trainer.store.lineage(seeded.model.ref))


def test_two_runs_of_one_identity_against_one_store_one_trains_the_other_refuses(trainer):
    """Started together: one holds the identity's lease in the store and trains; the other fails
    at once with LeaseHeld naming the holder (its launch), before launching anything."""
    import threading

    from components.store.lease import LeaseHeld

    outcomes: dict[int, object] = {}

    def run(i: int) -> None:
        try:
            outcomes[i] = trainer.run(*SHORT)
        except LeaseHeld as e:
            outcomes[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    refused = [o for o in outcomes.values() if isinstance(o, LeaseHeld)]
    trained = [o for o in outcomes.values() if not isinstance(o, LeaseHeld)]
    assert len(refused) == 1 and len(trained) == 1, outcomes
    launches = [m.ref.version for m in trainer.store.versions("run", trained[0].identity)]
    assert len(launches) == 1 and launches[0] in refused[0].holder  # the holder is the run that trained
    assert f"training identity {trained[0].identity} is held by" in str(refused[0])


def test_a_resuming_node_fetches_only_the_blocks_its_ranks_load(dataset_store, tmp_path, s3_env, s3_traffic):
    """FSDP over 2 nodes saves steps 10 and 12, its shard files (each rank's weights and its
    optimizer state) hashed in 16 KiB blocks; step 12 and the model are deleted from the store
    and the node disks wiped (new pods). The rerun resumes step 10: each node fetches its own
    rank's shard files and RNG state whole and, of the
    other rank's shard file, only the blocks of the items every rank reads (param groups, step
    counts), never the other rank's shards. Counted on the nodes' disks (a sparse file's
    allocated bytes) and, over S3, in the bytes the server sent per object. The rerun trains
    steps 11-12 to the uninterrupted run's weights. On the cluster's store, S3 (the local store's
    range reads: tests/test_store.py)."""
    traffic = s3_traffic
    trainer = s3_trainer(dataset_store, tmp_path, f"t-{uuid.uuid4().hex[:12]}")
    config = [*TWO_NODES, *SHORT[2:], "train.parallelism=fsdp", "train.steps=12", "train.checkpoint_interval=10"]
    block = 16 * 1024
    first = trainer.run(*config, f"train.checkpoint_block_kib={block // 1024}")
    steps = stored_steps(trainer, first.identity)
    trainer.store.remove(steps[12].ref, with_dependants=True)  # the model too: the rerun must train 11-12
    shutil.rmtree(first.run_dir / "nodes")
    shutil.rmtree(trainer.store_cfg.cache_dir, ignore_errors=True)
    at10 = steps[10]
    whole = trainer.store.fetch(at10, tmp_path / "whole-step10")  # the test's own copy, to read the layout
    shards = {n: e["size"] for n, e in at10.files.items() if n.endswith(".distcp")}
    assert sorted(shards) == ["__0_0.distcp", "__0_1.distcp", "__1_0.distcp", "__1_1.distcp"]  # weights, optimizer
    prefix = f"{trainer.store_cfg.bucket}/{at10.ref.prefix}/"
    before = dict(traffic.under(prefix))

    again = trainer.run(*config, f"train.checkpoint_block_kib={block // 1024}")
    assert again.result.resumed_from == str(at10.ref) and again.result.start_step == 10
    assert same(weights(first), weights(again))  # the blocks fetched are the bytes the load needed

    partial = []  # the other rank's files a node holds in part: the partial fetch ran
    for node, other in ((0, 1), (1, 0)):
        step10 = again.run_dir / "nodes" / str(node) / "checkpoints" / again.identity / f"node{node}" / "step-10"
        assert (step10 / f"rank{node}.pt").is_file() and not (step10 / f"rank{other}.pt").exists()
        for part in (0, 1):
            own, theirs = step10 / f"__{node}_{part}.distcp", step10 / f"__{other}_{part}.distcp"
            assert ckpt.sha256_file(own) == at10.files[own.name]["sha256"]  # its own shards: whole, verified
            most = shared_bytes(whole, theirs.name, block)
            assert allocated(theirs) <= min(most, 0.5 * shards[theirs.name]), (theirs, allocated(theirs), most)
            partial += [theirs] if allocated(theirs) > 0 else []
    assert partial  # some rank saved the items every rank reads (param groups, step counts)
    # what the S3 server sent
    after = traffic.under(prefix)
    sent = {n: after.get(prefix + n, 0) - before.get(prefix + n, 0) for n in shards}
    # each file went whole to its rank's node, and to the other node only its shared blocks
    for n in shards:
        assert shards[n] <= sent[n] <= shards[n] + shared_bytes(whole, n, block), (n, sent, shards)
