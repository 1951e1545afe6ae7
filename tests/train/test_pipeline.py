"""Pipeline parallelism under TorchX on two local nodes (gloo): the schedules train what one
process trains, and a pipeline checkpoint resumes data-parallel."""

from __future__ import annotations

import math

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
    the embeddings and blocks 0-1 (1F1B), blocks 0 and 2 (interleaved)."""
    common = [*COMMON, "train.steps=10"]
    one = one_process  # tests/conftest.py: trained once for the layout tests
    pp = trainer.run(*common, *TWO_NODES, "train.pp=2", "train.micro_batch_size=4", "train.grad_accum_steps=2")
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
    assert gpipe.result.wrapped_modules["pp_stages"] == 1
    assert_trains_like(one, (pp, inter, gpipe, pp_dp))


def test_a_pipeline_checkpoint_resumes_data_parallel_with_the_weights_and_samples_of_one_run(trainer):
    """Train PP=2 (1F1B, two nodes each holding two of the four blocks, 2 micro-batches of 4 a
    step), then continue its step-10 checkpoint data-parallel (DDP on two nodes, 4 sequences
    each) to step 20: each stage saved its own blocks under the full model's names and DCP
    loads them all into every DDP rank. The blocks read at every global sample position are an
    uninterrupted data-parallel run's (both stages read each of theirs: the first stage's
    inputs are the last stage's targets); the step-20 weights equal the uninterrupted PP run's
    within 1e-5 and the losses the uninterrupted DDP run's within 1e-5 relative. The same
    checkpoint resumes PP=2 too (each stage loads its own optimizer state by parameter name):
    its step-20 weights and losses are the uninterrupted PP run's within 1e-6."""
    common = [*COMMON, "train.steps=20"]
    pp_dir, dp_dir, whole_dir = (trainer.tmp / n for n in ("pp_rows", "dp_rows", "whole_rows"))
    with injected(record_dir=str(pp_dir)):
        pp = trainer.run(*common, *TWO_NODES, "train.pp=2", "train.micro_batch_size=4", "train.grad_accum_steps=2")
    at10 = stored_checkpoints(trainer, pp)[10].ref.version
    with injected(record_dir=str(dp_dir)):
        dp = trainer.run(*common, *TWO_NODES, "train.micro_batch_size=4", f"train.resume={at10}")
    assert dp.result.start_step == 10 and dp.result.resumed_from == f"checkpoint/tiny@{at10}"
    assert dp.result.wrapped_modules["pp_stages"] == 0 and dp.result.wrapped_modules["ddp"] == 1
    with injected(record_dir=str(whole_dir)):
        whole = Trainer(trainer.dataset_store, trainer.tmp / "whole").run(
            *common, *TWO_NODES, "train.micro_batch_size=4"
        )
    first_leg = {k: v for k, v in read_batches(pp_dir).items() if k < 10 * 8}
    assert all(len(v) == 2 and v[0] == v[1] for v in first_leg.values())  # both stages read each block
    got = {**{k: v[:1] for k, v in first_leg.items()}, **read_batches(dp_dir)}
    want = read_batches(whole_dir)
    assert sorted(got) == sorted(want) == list(range(20 * 8)) and got == want
    a, b = final_weights(pp), final_weights(dp)
    assert a.keys() == b.keys() and max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5
    resumed, uninterrupted = losses_of(dp), losses_of(whole)
    assert len(resumed) == len(uninterrupted) == 20
    assert all(math.isclose(x, y, rel_tol=1e-5) for x, y in zip(resumed, uninterrupted, strict=True))
    pp_again = ["train.pp=2", "train.micro_batch_size=4", "train.grad_accum_steps=2", f"train.resume={at10}"]
    again = trainer.run(*common, *TWO_NODES, *pp_again)
    assert again.result.start_step == 10 and again.result.wrapped_modules["pp_stages"] == 1
    c = final_weights(again)
    assert a.keys() == c.keys() and max(float((a[k] - c[k]).abs().max()) for k in a) < 1e-6
    assert all(math.isclose(x, y, rel_tol=1e-6) for x, y in zip(losses_of(again), losses_of(pp), strict=True))


def test_fp8_pipeline_names_a_later_stages_non_finite_module_and_every_stages_float8_linears(trainer):
    """fp8 under PP=2 (4 blocks, two a stage): a NaN put into block 3's down projection at step
    3 lives on the second stage, which rank 0 never runs: the step is skipped and its event
    names that module (every rank's finding gathered, the earliest in the forward kept), and
    the trained model's Float8Linear modules are both stages' (7 a block), not rank 0's half."""
    with injected(nan_weight="model.layers.3.mlp.down_proj.weight", nan_weight_steps=[3]):
        r = trainer.run(
            "train.precision=fp8", "train.steps=4", "train.warmup_steps=1", "model.num_layers=4", *TWO_NODES,
            "train.pp=2", "train.micro_batch_size=4", "train.grad_accum_steps=2", "train.activation_checkpointing=true",
        )  # fmt: skip
    bad = [e for e in read_records(r.metrics)[1] if e.get("kind") == "nonfinite_step"]
    assert [(e["step"], e["first_nonfinite_module"]) for e in bad] == [(3, "model.layers.3.mlp.down_proj")]
    assert r.result.skipped_steps == 1
    assert r.result.float8_linear_count == 28
    assert {m.split(".")[2] for m in r.result.float8_linear_modules} == {"0", "1", "2", "3"}
    assert r.result.wrapped_modules["activation_checkpoint"] == 2  # rank 0's two blocks, checkpointed
