"""Training end to end through TorchX local_cwd and torchrun, with real processes (-j 2x1)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import torch

from components import checkpoint_format as ckpt
from components.config import defaults
from components.launcher import LaunchError
from components.plots import read_records
from components.precision import PrecisionError
from components.store import Ref
from components.train.data import DataFitError
from components.train.resume import ResumeError
from tests.conftest import TRAIN_SHARDS, Trainer
from tests.faults import injected, read_batches
from tests.helpers import (
    LAYOUT,
    LAYOUT_BLOCKS,
    TWO_NODES,
    assert_trains_like,
    events,
    final_weights,
    killed_rank_resumes_to_identical_weights,
    stored_checkpoints,
)

REFERENCE = [*LAYOUT, "train.steps=10"]  # the one-process reference's config (tests/conftest.py)


def node_checkpoints(run, node: int) -> Path:
    """Where node `node` keeps its checkpoints: its own directory, as a pod's own disk."""
    return run.run_dir / "nodes" / str(node) / "checkpoints" / run.identity / f"node{node}"


def test_two_node_fp8_trains_float8_linears_and_learns_like_fp32(trainer):
    common = [*TWO_NODES, "train.steps=80", "train.checkpoint_interval=40", "train.activation_checkpointing=full"]
    fp8 = trainer.run(*common, "train.precision=fp8")
    fp32 = Trainer(trainer.dataset_store, trainer.tmp / "fp32").run(*common, "train.precision=fp32")
    bf16 = Trainer(trainer.dataset_store, trainer.tmp / "bf16").run(*common, "train.precision=bf16")
    # what trained: every block Linear (7 per block x 2 blocks) is a Float8Linear, the head is not
    expected = {f"model.layers.{i}.{m}" for i in range(2) for m in FP8_LINEARS}
    assert fp8.result.float8_linear_count == 14 and set(fp8.result.float8_linear_modules) == expected
    assert fp32.result.float8_linear_count == 0
    assert trainer.store.manifest(fp8.model.ref).metadata["float8_linear_count"] == 14
    # fp8 GEMMs change the numerics from the first step on (against fp32, and against bf16, which
    # is fp8's recipe minus the Float8Linears), and still learn as well as fp32
    fp8_steps, _ = read_records(fp8.metrics)
    fp32_steps, _ = read_records(fp32.metrics)
    bf16_steps, _ = read_records(bf16.metrics)
    # (the runs drift apart by ~1e-4 nats, so one float32 loss may coincide now and then; with
    # fp8 not applied every step would be bit-identical)
    for other in (fp32_steps, bf16_steps):
        same = [a["step"] for a, b in zip(fp8_steps[1:], other[1:], strict=True) if a["loss"] == b["loss"]]
        assert fp8_steps[1]["loss"] != other[1]["loss"] and len(same) <= 2, same
    assert fp8.final_loss < 0.8 * fp8_steps[0]["loss"], (fp8_steps[0]["loss"], fp8.final_loss)
    assert abs(fp8.final_loss - fp32.final_loss) <= 0.1 * fp32.final_loss, (fp8.final_loss, fp32.final_loss)
    # each node wrote only its own rank's shards, on its own disk; the store joined them
    for node in (0, 1):
        kept = ckpt.local_checkpoints(node_checkpoints(fp8, node))
        assert [p.name for p in kept] == ["step-80", "step-40"]
        # its model shards and its optimizer shards, each in a file of its own
        assert {p.name for p in kept[0].glob("*.distcp")} == {f"__{node}_0.distcp", f"__{node}_1.distcp"}
    stored = stored_checkpoints(trainer, fp8)
    assert sorted(stored) == [40, 80]
    assert {"__0_0.distcp", "__1_0.distcp", "rank0.pt", "rank1.pt", ".metadata"} <= set(stored[80].files)
    whole = trainer.store.fetch(stored[80], trainer.tmp / "fetched-step-80")
    assert ckpt.verify(whole)["step"] == 80
    stored = trainer.store.manifest(fp8.model.ref)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    export = fp8.export
    model = AutoModelForCausalLM.from_pretrained(str(export))
    tok = AutoTokenizer.from_pretrained(str(export))
    ids = torch.tensor([tok.encode("In the beginning")])
    assert torch.isfinite(model(ids).logits).all()
    assert any(p.startswith("checkpoint/tiny@") for p in stored.parents)
    assert trainer.store.exists(ckpt_ref(fp8.checkpoint_version))


FP8_LINEARS = [f"self_attn.{p}_proj" for p in "qkvo"] + [f"mlp.{p}_proj" for p in ("gate", "up", "down")]


@pytest.mark.parametrize(
    "recipe,casts",
    [
        ("tensorwise", "w:dyn_ten_e4m3,go_gw:dyn_ten_e5m2"),  # per-tensor scales, e5m2 gradients
        ("rowwise", "w:dyn_axs_e4m3,go_gw:dyn_axs_e4m3"),  # per-row scales
        ("rowwise_with_gw_hp", "w:dyn_axs_e4m3,go_gw:dis_ten_e4m3"),  # grad weight left in high precision
    ],
)
def test_every_fp8_recipe_trains_on_one_process(trainer, recipe, casts):
    assert_fp8_recipe_numerics(recipe)  # first, in this process: it fails in a second where it fails
    r = trainer.run("train.precision=fp8", f"train.fp8_recipe={recipe}", "train.steps=12", "train.warmup_steps=2")
    steps, _ = read_records(r.metrics)
    assert r.result.float8_linear_count == 14 and r.result.float8_cast_configs == [casts]
    assert r.final_loss < steps[0]["loss"]


E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def fp8_roundtrip(t: torch.Tensor, dtype, dim: int | None = None, pow2: bool = False) -> torch.Tensor:
    """`t` scaled so its amax (the whole tensor's, or along `dim`: one scale per slice across
    `dim`) is the float8 max, cast to `dtype` (saturated), and scaled back, in fp32; `pow2`
    rounds each scale down to a power of 2 first (torchao's rowwise recipes)."""
    amax = t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)
    scale = (torch.finfo(dtype).max / amax.double().clamp(min=1e-12)).float()
    if pow2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    big = torch.finfo(dtype).max
    return (t.float() * scale).clamp(-big, big).to(dtype).float() / scale


def fp8_by_hand(recipe: str, x, w, g) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Linear y = x @ w.T (x: tokens x in, w: out x in) under `recipe`, with grad_output g:
    (y, grad x, grad w), each GEMM's operands fp8-rounded with the scales the recipe takes along
    the dim that GEMM reduces over, the products in fp32."""
    if recipe == "tensorwise":  # one scale a tensor; e4m3 forward, e5m2 gradients
        xq, wq, gq = fp8_roundtrip(x, E4M3), fp8_roundtrip(w, E4M3), fp8_roundtrip(g, E5M2)
        return xq @ wq.t(), gq @ wq, gq.t() @ xq
    # rowwise: all e4m3, power-of-2 scales; y reduces over `in`: a scale per token of x, per output row of w
    y = fp8_roundtrip(x, E4M3, -1, True) @ fp8_roundtrip(w, E4M3, 1, True).t()
    g_per_token = fp8_roundtrip(g, E4M3, -1, True)  # grad x reduces over `out`
    if recipe == "rowwise":
        grad_x = g_per_token @ fp8_roundtrip(w, E4M3, 0, True)  # a scale per input column of w
        # grad w reduces over tokens: a scale per output column of g, per input column of x
        grad_w = fp8_roundtrip(g, E4M3, 0, True).t() @ fp8_roundtrip(x, E4M3, 0, True)
    else:  # rowwise_with_gw_hp: w tensorwise for grad x, grad w in high precision
        grad_x = g_per_token @ fp8_roundtrip(w, E4M3, None, True)
        grad_w = g.t() @ x
    return y, grad_x, grad_w


def assert_fp8_recipe_numerics(recipe: str) -> None:
    """The fp8 recipe's Linear (converted as training converts it: `FP8.apply`, emulated GEMMs on
    the CPU) computes its forward and both gradients as `fp8_by_hand` does, to fp32 rounding, and
    measurably unlike an nn.Linear: its GEMMs multiply fp8 operands scaled as the recipe says."""
    from components.config import Fp8Recipe, Precision, defaults
    from components.precision import recipe as precision_recipe

    torch.manual_seed(0)
    tokens, d_in, d_out = 48, 64, 32
    # magnitudes spread over tokens, features and output rows, so that per-tensor, per-row and
    # per-column scales each round differently
    x = torch.randn(tokens, d_in) * torch.logspace(-2, 1, tokens)[:, None] * torch.logspace(0, 1, d_in)
    w = torch.randn(d_out, d_in) * torch.logspace(-1, 1, d_out)[:, None] * torch.logspace(1, 0, d_in) / 32
    g = torch.randn(tokens, d_out) * torch.logspace(1, -2, tokens)[:, None] * torch.logspace(0, 1, d_out)

    def run(fp8: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        model = torch.nn.Sequential(torch.nn.Linear(d_in, d_out, bias=False))
        with torch.no_grad():
            model[0].weight.copy_(w)
        if fp8:
            train = defaults("train", precision=Precision.fp8, fp8_recipe=Fp8Recipe(recipe))
            precision_recipe(Precision.fp8).apply(model, train, torch.device("cpu"))
            assert type(model[0]).__name__ == "Float8Linear"
        xin = x.clone().requires_grad_(True)
        y = model(xin)
        y.backward(g)
        return y.detach(), xin.grad, model[0].weight.grad

    got, high, want = run(fp8=True), run(fp8=False), fp8_by_hand(recipe, x, w, g)
    for name, a, hp, b in zip(("output", "grad input", "grad weight"), got, high, want, strict=True):
        scale = float(b.abs().max())
        off = float((a - b).abs().max()) / scale
        assert off <= 1e-6, f"{recipe}: {name} is {off:.2e} (relative) off the fp8 emulation by hand"
        if name != "grad weight" or recipe != "rowwise_with_gw_hp":  # that one is high precision
            unlike = float((a - hp).abs().max()) / scale
            assert unlike > 1e-3, f"{recipe}: {name} is the high-precision Linear's ({unlike:.2e} off it)"


def ckpt_ref(version: str):
    from components.store import Ref

    return Ref("checkpoint", "tiny", version)


def test_killed_rank_resumes_to_identical_weights(dataset_store, tmp_path):
    killed_rank_resumes_to_identical_weights(dataset_store, tmp_path, [])


def test_resume_auto_continues_from_the_store(trainer):
    first = trainer.run("train.steps=20", "train.checkpoint_interval=10")
    import shutil

    shutil.rmtree(first.run_dir)  # a new pod: nothing local, the store has the checkpoints
    again = trainer.run("train.steps=20", "train.checkpoint_interval=10")
    start = events(again.metrics, "start")[-1]
    assert start["step"] == 20 and again.identity == first.identity


def test_nan_batches_are_skipped_named_and_rolled_back(trainer):
    with injected(nan_steps=[5, 12, 13, 14]):
        r = trainer.run("train.steps=16", "train.checkpoint_interval=10", "train.max_bad_steps=3")
    bad = events(r.metrics, "nonfinite_step")
    assert [e["step"] for e in bad] == [5, 12, 13, 14]
    assert all(e["first_nonfinite_module"] == "model.embed_tokens" for e in bad)
    assert bad[-1]["skipped_total"] == 4 and r.result.skipped_steps == 4
    rollback = events(r.metrics, "rollback")
    assert len(rollback) == 1 and rollback[0]["step"] == 14 and "-step10-" in rollback[0]["to"]
    assert all(s["stepped"] for s in read_records(r.metrics)[0] if s["step"] in (15, 16))


def test_nonfinite_inside_a_compiled_block_is_named_and_skipped(trainer):
    with injected(nan_weight="model.layers.1.mlp.down_proj.weight", nan_weight_steps=[5]):
        r = trainer.run("train.steps=8", "train.checkpoint_interval=4", "train.compile=true")
    assert r.result.wrapped_modules["compiled"] == 2
    bad = events(r.metrics, "nonfinite_step")
    assert [(e["step"], e["first_nonfinite_module"]) for e in bad] == [(5, "model.layers.1.mlp.down_proj")]
    steps, _ = read_records(r.metrics)
    assert [s["step"] for s in steps if s["stepped"]] == [1, 2, 3, 4, 6, 7, 8]


def test_slow_rank_is_reported_and_hang_trips_the_watchdog(trainer, capfd):
    start = time.monotonic()
    faults = injected(slow_rank=1, slow_seconds=0.3, hang_rank=1, hang_step=9)
    with pytest.raises(LaunchError) as err, faults:
        trainer.run(*TWO_NODES, "train.steps=30", "train.straggler_interval=4", "train.watchdog_timeout_s=8")
    assert time.monotonic() - start < 120
    message = str(err.value)
    # the rank whose watchdog fired is the first failure (not a peer its exit disconnected)
    assert "WatchdogTimeout: no training progress" in message.split("failed after it")[0], message
    assert "Thread 0x" in message and "most recent call first" in message  # the stacks, in the error
    assert "watchdog: no training progress" in capfd.readouterr().out
    node0 = next((trainer.tmp / "runs").iterdir()) / "nodes" / "0"  # the run never handed anything back
    slow = events(node0 / "run" / "metrics.jsonl", "straggler")
    assert slow and all(e["rank"] == 1 and e["host"] for e in slow)


@pytest.mark.parametrize(
    "overrides,error,match",
    [
        (
            [
                "train.precision=fp8",
                "model.hidden_size=40",
                "model.ffn_hidden_size=100",
                "model.num_heads=4",
                "model.num_kv_heads=4",
            ],
            PrecisionError,
            "no Linear layer has both dims divisible by 16",
        ),
        (["model.vocab_size=500"], ValueError, "vocab mismatch: the dataset's tokenizer has 1024 tokens"),
        (["train.micro_batch_size=4096"], DataFitError, "train split has only"),
        (["train.resume=nope-step10"], ResumeError, "no checkpoint/tiny@nope-step10"),
    ],
)
def test_bad_input_fails_before_launch(trainer, overrides, error, match, capfd):
    with pytest.raises(error, match=match):
        trainer.run(*overrides)
    assert "launched" not in capfd.readouterr().err
    assert not (trainer.tmp / "runs").exists()


@pytest.mark.chaos_slow  # 32 s, two to three runs: in `make chaos`
def test_a_longer_run_seeded_with_the_shorter_continues_it_on_another_world_size(trainer):
    """`train.resume=<version>` continues another run (here a longer one, on another world size):
    20 steps on 2 ranks, then 30 steps on 1 rank seeded with the 20-step checkpoint continues at
    step 20. The blocks the ranks actually read (hashed from the rows handed to the model, by
    global sample number) across the two legs are those of an uninterrupted 1-rank run of as
    many samples: same block at every position, none repeated or skipped, across shard
    boundaries of the dataset's 4 shards (micro batches of 32 move through more than one shard
    per leg)."""
    legs, whole, micro = trainer.tmp / "legs", trainer.tmp / "whole", "train.micro_batch_size=32"
    with injected(record_dir=str(legs)):
        first = trainer.run(*TWO_NODES, micro, "train.steps=20", "train.checkpoint_interval=10")
        seed = f"train.resume={first.checkpoint_version}"
        longer = trainer.run(micro, "train.steps=30", "train.checkpoint_interval=10", seed)
    assert longer.identity != first.identity  # another schedule: continuing it is explicit
    assert longer.result.resumed_from == f"checkpoint/tiny@{first.checkpoint_version}"
    assert longer.result.start_step == 20 and longer.result.world == 1
    resumed_at, samples = 20 * 32 * 2, 20 * 32 * 2 + 10 * 32  # 2 ranks x 20 steps, then 1 rank x 10
    assert ckpt.verify(node_checkpoints(longer, 0) / "step-30")["samples"] == samples
    with injected(record_dir=str(whole)):
        Trainer(trainer.dataset_store, trainer.tmp / "w").run(micro, "train.steps=50")
    got, want = read_batches(legs), read_batches(whole)
    assert sorted(got) == sorted(want) == list(range(samples))  # every position once: none skipped or repeated
    assert got == want  # the same block at each position
    assert len({h for ((h, _),) in want.values()}) == samples  # within one epoch: no block twice

    def shards(positions) -> set[int]:
        return {got[k][0][1] for k in positions}

    assert len(shards(range(resumed_at))) >= 2  # the first leg alone switched shards
    assert len(trainer.store.manifest(Ref.parse(trainer.dataset)).metadata["shards"]) == TRAIN_SHARDS


def test_a_shorter_rerun_trains_its_own_steps_instead_of_handing_back_the_longer_model(trainer):
    longer = trainer.run("train.steps=20", "train.checkpoint_interval=10")
    shorter = trainer.run("train.steps=10", "train.checkpoint_interval=10")
    assert shorter.identity != longer.identity and shorter.result.resumed_from is None  # fresh
    assert shorter.model.ref != longer.model.ref and shorter.result.checkpoint == "step-10"
    # its own schedule: the 20-step run's step-10 checkpoint holds other weights
    theirs = stored_checkpoints(trainer, longer)[10].ref.version
    assert theirs != shorter.checkpoint_version
    step20 = stored_checkpoints(trainer, longer)[20].ref.version
    with pytest.raises(ResumeError, match="is at step 20, nothing left to train with train.steps=10"):
        trainer.run("train.steps=10", f"train.resume={step20}")


@pytest.mark.chaos_slow  # 32 s, two to three runs: in `make chaos`
def test_a_relaunch_after_a_named_seed_keeps_the_seed_when_nothing_was_saved_since(trainer):
    """train.resume=<version of another identity> seeds attempt 0; a relaunch that finds no
    checkpoint of its own yet starts from the seed again, not from scratch."""
    seed = trainer.run(*TWO_NODES, "train.steps=10", "train.checkpoint_interval=10")
    branch = [*TWO_NODES, "train.lr=1e-3", "train.steps=20", "train.checkpoint_interval=5", "cluster.max_restarts=1"]
    with injected(kill_rank=1, kill_step=12):
        r = trainer.run(*branch, f"train.resume={seed.checkpoint_version}")
    assert r.identity != seed.identity
    # the relaunch resumed from the seed again (the seed's history, restored, carries its own start)
    assert r.result.start_step == 10 and r.result.resumed_from == f"checkpoint/tiny@{seed.checkpoint_version}"
    assert events(r.metrics, "start")[-1]["step"] == 10


def test_rerun_with_other_weights_publishes_a_new_model_version(trainer):
    """resume=never with the same identity but different weights (a code change, here a NaN
    step the second run skips) is a new model version; validate judges the new one."""
    from components.validate.stage import run_validate

    common = ["train.steps=10", "train.checkpoint_interval=5", "train.resume=never"]
    first = trainer.run(*common)
    with injected(nan_steps=[3]):
        second = trainer.run(*common)
    assert second.identity == first.identity and second.model.ref != first.model.ref
    assert {m.ref for m in trainer.store.versions("model", "tiny")} == {first.model.ref, second.model.ref}
    verdict = run_validate(str(second.model.ref), defaults("eval"), trainer.store)
    assert verdict.numbers["checkpoint_max_abs_diff"] == 0.0  # its own checkpoint, not the first run's
    assert verdict.numbers["recorded_loss"] == second.result.probe_loss != first.result.probe_loss
    assert second.checkpoint_version != first.checkpoint_version
    from components.evaluate.stage import run_evaluate

    evaluation = run_evaluate(str(second.model.ref), defaults("eval", val_blocks=8, prompts=[]), trainer.store)
    assert str(second.model.ref) in evaluation.manifest.parents


def test_a_stored_checkpoint_version_with_other_content_is_an_error(trainer, tmp_path):
    from components.store import IntegrityError

    r = trainer.run("train.steps=5", "train.warmup_steps=1", "train.checkpoint_interval=5")
    stored = trainer.store.resolve("checkpoint", "tiny", r.checkpoint_version)
    local = trainer.store.fetch(stored, tmp_path / "copy")
    (local / "meta.json").write_text("{}")
    with pytest.raises(IntegrityError, match="already exists .* other content .*meta.json"):
        trainer.store.publish("checkpoint", "tiny", r.checkpoint_version, local, same_content=True)


def test_resume_from_checkpoint_of_another_shape_fails_before_launch(trainer):
    r = trainer.run("train.steps=10", "train.checkpoint_interval=10")
    with pytest.raises(ResumeError, match="another model shape: .*num_layers=2 there vs 3 here"):
        trainer.run("train.steps=10", f"train.resume={r.checkpoint_version}", "model.num_layers=3")


def test_metrics_jsonl_has_the_monitoring_fields(trainer):
    r = trainer.run("train.steps=6", "train.warmup_steps=2", "train.peak_tflops=0.1")
    steps, evs = read_records(r.metrics)
    keys = {
        "loss",
        "grad_norm",
        "lr",
        "tokens_per_s",
        "mfu",
        "data_s",
        "fwd_bwd_s",
        "optimizer_s",
        "comm_s",
        "peak_memory_bytes",
    }
    assert keys <= set(steps[0]) and 0 < steps[-1]["mfu"] < 1
    assert list((r.run_dir / "nodes" / "0" / "run" / "tensorboard").glob("events.out.tfevents.*"))
    # the driver's only channel back is the store: the run's record, fetched, not a file the
    # replicas left on a disk the driver happens to share locally
    assert not list(r.run_dir.rglob("result.json"))
    record = trainer.store.resolve("run", r.identity, "latest")
    assert json.loads((trainer.store.fetch(record) / "result.json").read_text())["steps"] == 6
    assert record.parents == [str(r.model.ref)] and r.metrics.is_relative_to(trainer.store_cfg.cache_dir)


def test_val_loss_and_one_tensorboard_event_file_per_run_are_published_with_the_model(trainer):
    """Periodic validation on the fixed held-out blocks, and a longer rerun of the same training
    (it resumes at step 10 in the same run directory): the run keeps one event file, and the
    model the rerun publishes carries it, with every step once and the val points of both legs."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    common = ["train.val_interval=4", "train.checkpoint_interval=5", "train.warmup_steps=2"]
    first = trainer.run("train.steps=10", *common)
    longer = trainer.run("train.steps=15", *common, f"train.resume={first.checkpoint_version}")
    assert longer.result.start_step == 10 and events(longer.metrics, "start")[-1]["step"] == 10
    assert [v["step"] for v in events(longer.metrics, "val")] == [4, 8, 10, 12, 15]
    assert all(v["val_blocks"] == 32 and 0 < v["val_loss"] < 10 for v in events(longer.metrics, "val"))
    on_node = list((longer.run_dir / "nodes" / "0" / "run" / "tensorboard").glob("events.out.tfevents.*"))
    published = list((longer.export / "tensorboard").glob("events.out.tfevents.*"))
    assert len(on_node) == 1 and len(published) == 1 and published[0].name == on_node[0].name
    scalars = EventAccumulator(str(published[0])).Reload()
    assert [e.step for e in scalars.Scalars("train/loss")] == list(range(1, 16))
    assert [e.step for e in scalars.Scalars("val/loss")] == [4, 8, 10, 12, 15]
    assert (longer.export / "training_metrics.jsonl").read_text() == longer.metrics.read_text()


def test_fsdp_trains_the_same_weights_as_ddp(trainer):
    """FSDP2's sharded training against DDP as the reference implementation: same seed, same
    data, fp32, two ranks; only the reduction order differs."""
    common = [*TWO_NODES, "train.precision=fp32", "train.steps=10", "train.warmup_steps=2"]
    ddp = trainer.run(*common, "train.parallelism=ddp", "train.checkpoint_interval=10")
    # the FSDP side's loss in chunks of 128 tokens (4 a micro-batch): the same weights as DDP's whole one
    fsdp = Trainer(trainer.dataset_store, trainer.tmp / "fsdp").run(
        *common, "train.parallelism=fsdp", "train.loss_chunk_tokens=128"
    )
    assert fsdp.result.wrapped_modules["fsdp"] == 3 and ddp.result.wrapped_modules["fsdp"] == 0
    assert fsdp.result.wrapped_modules["fsdp_reshard_after_forward"] == 2  # the blocks; the root keeps its own
    a, b = final_weights(ddp), final_weights(fsdp)
    assert a.keys() == b.keys()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-4
    from components.models import build_model

    init = build_model(defaults("model"), 1024, seed=0).state_dict()
    assert max(float((a[k] - init[k]).abs().max()) for k in a) > 1e-3  # it did train


def test_hsdp_2x2_on_two_nodes_trains_the_losses_and_weights_of_one_process(trainer, one_process):
    """HSDP: 2 nodes x 2 processes, parameters sharded within a node and replicated across the
    two; same global batch (4 ranks x 2 sequences) as one process with 8. fp32, 10 steps: the
    losses within 1e-4 relative, the weights within 1e-4; the live model's parameters are
    DTensors replicated over one mesh dimension and sharded over the other. The run also
    checkpoints selectively (one launch for both): all 4 blocks run under the per-op policy
    (their checkpoint has its context), and the ops recomputed in backward change nothing
    against the one process that saves everything; what the policy saves is held to the plan by
    tests/preflight/test_plan.py (its outputs read from the policy's own cache)."""
    one = one_process
    hsdp = trainer.run(
        *REFERENCE, "cluster.nodes=2", "cluster.procs_per_node=2", "train.parallelism=fsdp", "train.dp_replicate=2",
        "train.micro_batch_size=2", "train.activation_checkpointing=selective",
    )  # fmt: skip
    wrapped = hsdp.result.wrapped_modules
    assert wrapped["activation_checkpoint"] == wrapped["selective_checkpoint"] == LAYOUT_BLOCKS
    assert one.result.wrapped_modules["activation_checkpoint"] == 0
    from components.models import build_model

    params = len(list(build_model(defaults("model", num_layers=LAYOUT_BLOCKS), 1024, seed=0).parameters()))
    assert hsdp.result.world == 4 and hsdp.result.wrapped_modules["hsdp_params"] == params
    assert one.result.wrapped_modules["hsdp_params"] == 0
    losses = [[r["loss"] for r in read_records(run.metrics)[0]] for run in (one, hsdp)]
    assert len(losses[0]) == len(losses[1]) == 10
    assert all(abs(a - b) <= 1e-4 * abs(a) for a, b in zip(*losses, strict=True)), losses
    a, b = final_weights(one), final_weights(hsdp)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-4


def test_fsdp_bf16_async_checkpoints_on_two_nodes(trainer):
    from components.validate.stage import run_validate

    r = trainer.run(
        *TWO_NODES,
        "train.parallelism=fsdp",
        "train.precision=bf16",
        "train.checkpoint_async=true",
        "train.activation_checkpointing=full",
        "train.steps=30",
        "train.checkpoint_interval=10",
    )
    steps, _ = read_records(r.metrics)
    assert r.final_loss < 0.9 * steps[0]["loss"]
    for node in (0, 1):
        assert [c.name for c in ckpt.local_checkpoints(node_checkpoints(r, node))] == ["step-30", "step-20"]
    stored = stored_checkpoints(trainer, r)
    assert sorted(stored) == [20, 30]  # step-10 published, then retired by retention (checkpoint_keep=2)
    assert all(ckpt.verify(trainer.store.fetch(m, trainer.tmp / f"whole-{s}")) for s, m in stored.items())
    # the FSDP-sharded checkpoint and the gathered HF export hold the same weights
    verdict = run_validate(str(r.model.ref), defaults("eval", loss_tolerance=1.0), trainer.store)
    assert verdict.numbers["checkpoint_max_abs_diff"] == 0.0


def test_tensor_parallel_trains_the_losses_and_weights_of_one_process(trainer, one_process):
    """TP=2 on two nodes (one process each: the pair splits every block's matmuls, both read the
    same 8 sequences) and TP=2 x FSDP=2 on 2 nodes x 2 processes (2 data-parallel ranks of 4):
    the global batch of one process with 8. fp32, 10 steps: losses within 1e-4 relative and
    weights within 1e-4 of the one process; the live models' block projections, head and
    embedding (split by vocabulary under sequence parallel, the default) are DTensors split
    over the tp mesh dimension, FSDP's on top in the 2-D run; the loss is the loss-parallel one."""
    one = one_process
    tp = trainer.run(*REFERENCE, *TWO_NODES, "train.tp=2", "train.micro_batch_size=8")
    tp_fsdp = Trainer(trainer.dataset_store, trainer.tmp / "tp_fsdp").run(
        *REFERENCE, "cluster.nodes=2", "cluster.procs_per_node=2", "train.parallelism=fsdp", "train.tp=2",
        "train.micro_batch_size=4",
    )  # fmt: skip
    split = 7 * LAYOUT_BLOCKS + 2  # q, k, v, o, gate, up, down per block, the head, the embedding (sequence parallel)
    assert tp.result.wrapped_modules["tp_params"] == split and tp.result.wrapped_modules["fsdp"] == 0
    assert (
        tp_fsdp.result.wrapped_modules["tp_params"] == split
        and tp_fsdp.result.wrapped_modules["fsdp"] == LAYOUT_BLOCKS + 1
    )
    assert one.result.wrapped_modules["tp_params"] == 0
    assert_trains_like(one, (tp, tp_fsdp))


def test_fp8_tensor_parallel_splits_float8_linear_weights_over_tp(trainer):
    """fp8 with TP=2: every Float8Linear of the live model holds its weight as a DTensor split
    over the tp dimension (torchao's float8 TP styles), and the run trains finite losses."""
    run = trainer.run(
        *TWO_NODES, "train.tp=2", "train.precision=fp8", "train.steps=3", "train.warmup_steps=1",
        "train.checkpoint_interval=3", "train.micro_batch_size=4",
    )  # fmt: skip
    blocks = defaults("model").num_layers
    assert run.result.float8_linear_count == 7 * blocks
    assert run.result.wrapped_modules["float8_tp_linear"] == 7 * blocks
    losses = [r["loss"] for r in read_records(run.metrics)[0]]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)


def test_a_tensor_parallel_checkpoint_resumes_data_parallel_with_the_weights_and_samples_of_one_run(trainer):
    """Train TP=2 (two nodes splitting every block, 8 sequences a step), then continue its
    step-10 checkpoint data-parallel (DDP on two nodes, 4 sequences each) to step 20: DCP
    reshards the tensor-parallel DTensors into whole tensors. The blocks read at every global
    sample position (hashed from the rows handed to the model) are an uninterrupted
    data-parallel run's; both TP ranks read each of theirs. The weights at step 20 equal the
    uninterrupted TP run's within 1e-5 (nothing is lost across the change of layout); against
    the uninterrupted DDP run they agree only to the layouts' rounding (fp32 Adam turns the
    different reduction orders of TP and DDP into ~1e-4 apart after 20 steps, and one process
    and DDP are already 1.6e-5 apart), so there the losses are held to 1e-5 relative."""
    common = ["train.precision=fp32", "train.steps=20", "train.warmup_steps=2", "train.checkpoint_interval=10"]
    tp_dir, dp_dir, whole_dir = (trainer.tmp / n for n in ("tp_rows", "dp_rows", "whole_rows"))
    with injected(record_dir=str(tp_dir)):
        tp = trainer.run(*common, *TWO_NODES, "train.tp=2", "train.micro_batch_size=8")
    at10 = stored_checkpoints(trainer, tp)[10].ref.version
    with injected(record_dir=str(dp_dir)):
        dp = trainer.run(*common, *TWO_NODES, "train.micro_batch_size=4", f"train.resume={at10}")
    assert dp.result.start_step == 10 and dp.result.resumed_from == f"checkpoint/tiny@{at10}"
    with injected(record_dir=str(whole_dir)):
        whole = Trainer(trainer.dataset_store, trainer.tmp / "whole").run(
            *common, *TWO_NODES, "train.micro_batch_size=4"
        )
    first_leg = {k: v for k, v in read_batches(tp_dir).items() if k < 10 * 8}
    assert all(len(v) == 2 and v[0] == v[1] for v in first_leg.values())  # the TP pair read one batch
    got = {**{k: v[:1] for k, v in first_leg.items()}, **read_batches(dp_dir)}
    want = read_batches(whole_dir)
    assert sorted(got) == sorted(want) == list(range(20 * 8)) and got == want
    a, b = final_weights(tp), final_weights(dp)
    assert a.keys() == b.keys() and max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5
    resumed = [r["loss"] for r in read_records(dp.metrics)[0]]
    uninterrupted = [r["loss"] for r in read_records(whole.metrics)[0]]
    assert len(resumed) == len(uninterrupted) == 20
    assert all(math.isclose(x, y, rel_tol=1e-5) for x, y in zip(resumed, uninterrupted, strict=True))
