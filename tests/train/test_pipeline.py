"""Pipeline parallelism under TorchX on two local nodes (gloo): the schedules train what one
process trains, and a pipeline checkpoint resumes data-parallel."""

from __future__ import annotations

import math

import pytest

from components.plots import read_records
from tests.conftest import Trainer
from tests.faults import injected, read_batches
from tests.helpers import LAYOUT, TWO_NODES, assert_trains_like, final_weights, stored_checkpoints

# four blocks: two stages of two (1F1B), or four of one, two per rank (interleaved 1F1B)
COMMON = LAYOUT
BLOCK_PARAMS = 9  # q, k, v, o, gate, up, down and two norms


def losses_of(run) -> list[float]:
    return [r["loss"] for r in read_records(run.metrics)[0]]


def test_pipeline_schedules_train_the_losses_and_weights_of_one_process(trainer, one_process):
    """PP=2 with 1F1B, interleaved 1F1B and GPipe (2 nodes x 1 process, 2 micro-batches of 4
    through the stages) and PP=2 x FSDP=2 (2 nodes x 2 processes, 2 x 2 each): the global batch
    of one process with 8. fp32, 10 steps: losses within 1e-4 relative and exported weights
    within 1e-4 of the one process. Rank 0's live module holds only its stages' parameters:
    the embeddings and blocks 0-1 (1F1B), blocks 0 and 2 (interleaved); under FSDP a stage's
    blocks keep their gathered parameters after forward (torchtitan's choice: the schedule runs
    every micro-batch through them)."""
    common = [*COMMON, "train.steps=10"]
    one = one_process  # tests/conftest.py: trained once for the layout tests
    # 1F1B's loss in chunks of 64 tokens (4 a pipeline micro-batch): the schedule's loss_fn too
    pp = trainer.run(*common, *TWO_NODES, "train.pp=2", "train.micro_batch_size=4", "train.grad_accum_steps=2",
                     "train.loss_chunk_tokens=64")  # fmt: skip
    inter = Trainer(trainer.dataset_store, trainer.tmp / "inter").run(
        *common, *TWO_NODES, "train.pp=2", "train.pp_schedule=interleaved_1f1b", "train.micro_batch_size=4",
        "train.grad_accum_steps=2",
    )  # fmt: skip
    gpipe = Trainer(trainer.dataset_store, trainer.tmp / "gpipe").run(
        *common, *TWO_NODES, "train.pp=2", "train.pp_schedule=gpipe", "train.micro_batch_size=4",
        "train.grad_accum_steps=2",
    )  # fmt: skip
    pp_dp = Trainer(trainer.dataset_store, trainer.tmp / "pp_dp").run(
        *common, "cluster.nodes=2", "cluster.procs_per_node=2", "train.pp=2", "train.parallelism=fsdp",
        "train.micro_batch_size=2", "train.grad_accum_steps=2",
    )  # fmt: skip
    held = [run.result.wrapped_modules for run in (one, pp, inter, pp_dp)]
    assert held[0]["pp_stages"] == 0 and held[0]["params_held"] == 1 + 4 * BLOCK_PARAMS + 2
    assert held[1]["pp_stages"] == 1 and held[1]["params_held"] == 1 + 2 * BLOCK_PARAMS  # embeddings, 2 blocks
    assert held[2]["pp_stages"] == 2 and held[2]["params_held"] == 1 + 2 * BLOCK_PARAMS
    assert held[3]["pp_stages"] == 1 and held[3]["fsdp"] == 3  # its 2 blocks and the stage
    assert held[3]["fsdp_reshard_after_forward"] == 0  # a stage's blocks stay gathered: one all-gather a step
    assert gpipe.result.wrapped_modules["pp_stages"] == 1
    assert_trains_like(one, (pp, inter, gpipe, pp_dp))


def test_pp_x_tp_trains_the_losses_and_weights_of_one_process(trainer, one_process):
    """PP=2 x TP=2 on 2 nodes x 2 processes (`liftoff config train.tp=2 train.pp=2 ...` as it
    composes: 8 sequences a step, split into 2 pipeline micro-batches of 4): each node is a
    stage, its two processes split the stage's blocks' matmuls and, under sequence parallel
    (the default), the sequence between them: a stage sends each tp rank's half of it on, and
    the last stage's loss-parallel head never gathers its logits. fp32, 10 steps: losses within
    1e-4 relative and weights within 1e-4 of the one process. Rank 0's live module holds the
    embeddings and blocks 0-1 only, its 14 block projections and the embedding (split by
    vocabulary: sequence parallel) DTensors split over tp, the norms replicated."""
    pp_tp = trainer.run(*COMMON, "train.steps=10", "cluster.nodes=2", "cluster.procs_per_node=2", "train.pp=2",
                        "train.tp=2")  # fmt: skip
    held = pp_tp.result.wrapped_modules
    assert held["pp_stages"] == 1 and held["params_held"] == 1 + 2 * BLOCK_PARAMS
    assert held["tp_params"] == 7 * 2 + 1 and held["fsdp"] == 0 and held["ddp"] == 0
    assert held["tp_replicated_params"] == 2 * 2  # its blocks' norms, on the tp mesh (sequence parallel)
    assert_trains_like(one_process, (pp_tp,))


@pytest.mark.chaos_slow  # 8 processes on 2 cores: in `make chaos`; the 4-process PP x TP test is in `make test`
def test_pp_x_tp_x_fsdp_on_eight_processes_trains_the_losses_and_weights_of_one_process(trainer, one_process):
    """PP=2 x TP=2 x FSDP=2 on 2 nodes x 4 processes: each node a stage, in it 2 FSDP shards of
    a TP pair; 2 data-parallel ranks of 4 sequences (each split into 2 pipeline micro-batches
    of 2). fp32, 10 steps: losses within 1e-4 relative and weights within 1e-4 of the one
    process; rank 0's 2 blocks' projections split over tp and its 2 blocks and stage FSDP units."""
    run = trainer.run(*COMMON, "train.steps=10", "cluster.nodes=2", "cluster.procs_per_node=4", "train.pp=2",
                      "train.tp=2", "train.parallelism=fsdp", "train.micro_batch_size=4")  # fmt: skip
    held = run.result.wrapped_modules
    assert held["pp_stages"] == 1 and held["tp_params"] == 7 * 2 + 1 and held["fsdp"] == 3
    assert_trains_like(one_process, (run,))


@pytest.mark.chaos_slow  # 4 runs of 4 processes (72 s): in `make chaos` only (docs/reliability.md)
def test_a_pp_x_tp_checkpoint_resumes_under_fsdp_and_back_with_the_samples_and_weights_of_one_run(trainer):
    """Train PP=2 x TP=2 (2 nodes x 2 processes: a stage a node, its matmuls split over the
    node's pair; 8 sequences a step) and FSDP=4 (the same 4 processes, 2 sequences each), 8
    steps each, uninterrupted; then continue each one's step-4 checkpoint in the other layout.
    Each stage saved its own blocks' tp shards under the full model's names, and DCP reshards
    them into FSDP's dp shards (and FSDP's back into stages and tp shards, each stage loading its
    own optimizer state by parameter name). The blocks read at every global sample position are
    the uninterrupted runs' (all four PP x TP ranks read each block of theirs); the step-8
    weights equal the uninterrupted run of the first leg's layout within 1e-5 and the losses the
    second leg's within 1e-5 relative (8 steps apart, the two layouts' reduction orders differ
    by more than that: see the TP resume test)."""
    common = [*COMMON, "train.steps=8", "train.checkpoint_interval=4", "cluster.nodes=2", "cluster.procs_per_node=2"]
    pp_tp, fsdp = ["train.pp=2", "train.tp=2"], ["train.parallelism=fsdp", "train.micro_batch_size=2"]
    dirs = {n: trainer.tmp / f"{n}_rows" for n in ("pp_tp", "fsdp", "to_fsdp", "to_pp_tp")}
    with injected(record_dir=str(dirs["pp_tp"])):
        a = trainer.run(*common, *pp_tp)
    other = Trainer(trainer.dataset_store, trainer.tmp / "other")  # a store of its own
    with injected(record_dir=str(dirs["fsdp"])):
        b = other.run(*common, *fsdp)
    a4, b4 = stored_checkpoints(trainer, a)[4].ref.version, stored_checkpoints(other, b)[4].ref.version
    with injected(record_dir=str(dirs["to_fsdp"])):
        to_fsdp = trainer.run(*common, *fsdp, f"train.resume={a4}")
    with injected(record_dir=str(dirs["to_pp_tp"])):
        to_pp_tp = other.run(*common, *pp_tp, f"train.resume={b4}")
    assert to_fsdp.result.start_step == to_pp_tp.result.start_step == 4
    assert to_fsdp.result.wrapped_modules["pp_stages"] == 0 and to_fsdp.result.wrapped_modules["fsdp"] == 5
    assert (
        to_pp_tp.result.wrapped_modules["pp_stages"] == 1 and to_pp_tp.result.wrapped_modules["tp_params"] == 15
    )  # the embedding too: sequence parallel
    rows = {n: read_batches(d) for n, d in dirs.items()}
    assert all(len(v) == 4 and len(set(v)) == 1 for n in ("pp_tp", "to_pp_tp") for v in rows[n].values())
    first = {n: {k: v[:1] for k, v in rows[n].items() if k < 4 * 8} for n in ("pp_tp", "fsdp")}
    second = {n: {k: v[:1] for k, v in rows[n].items()} for n in ("to_fsdp", "to_pp_tp")}
    assert sorted(rows["fsdp"]) == list(range(8 * 8))
    assert {**first["pp_tp"], **second["to_fsdp"]} == {**first["fsdp"], **second["to_pp_tp"]} == rows["fsdp"]
    for resumed, first_leg, second_leg in ((to_fsdp, a, b), (to_pp_tp, b, a)):
        w, x = final_weights(resumed), final_weights(first_leg)
        assert w.keys() == x.keys() and max(float((w[k] - x[k]).abs().max()) for k in w) < 1e-5
        got, want = losses_of(resumed), losses_of(second_leg)
        assert len(got) == len(want) == 8
        assert all(math.isclose(x, y, rel_tol=1e-5) for x, y in zip(got, want, strict=True))


def test_fp8_pp_x_tp_names_a_later_stages_non_finite_module_and_splits_every_float8_linear(trainer):
    """fp8 under PP=2 x TP=2 (4 blocks, two a stage; each stage's matmuls split over its node's
    two processes): a NaN put into block 3's down projection at step 3 lives on the second
    stage, which rank 0 never runs: the step is skipped and its event names that module (every
    rank's finding gathered, the earliest in the forward kept); the trained model's
    Float8Linear modules are both stages' (7 a block), and rank 0's 14 hold their weights as
    DTensors split over tp (torchao's float8 TP styles, read off the live model)."""
    with injected(nan_weight="model.layers.3.mlp.down_proj.weight", nan_weight_steps=[3]):
        r = trainer.run(
            "train.precision=fp8", "train.steps=4", "train.warmup_steps=1", "model.num_layers=4", "cluster.nodes=2",
            "cluster.procs_per_node=2", "train.pp=2", "train.tp=2", "train.micro_batch_size=4",
            "train.grad_accum_steps=2", "train.activation_checkpointing=full",
        )  # fmt: skip
    bad = [e for e in read_records(r.metrics)[1] if e.get("kind") == "nonfinite_step"]
    assert [(e["step"], e["first_nonfinite_module"]) for e in bad] == [(3, "model.layers.3.mlp.down_proj")]
    assert r.result.skipped_steps == 1
    assert r.result.float8_linear_count == 28
    assert {m.split(".")[2] for m in r.result.float8_linear_modules} == {"0", "1", "2", "3"}
    assert r.result.wrapped_modules["activation_checkpoint"] == 2  # rank 0's two blocks, checkpointed
    assert r.result.wrapped_modules["float8_tp_linear"] == 14  # rank 0's two blocks' Float8Linears, split
