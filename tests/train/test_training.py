"""Training end to end through TorchX local_cwd and torchrun, with real processes (-j 2x1)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from components.launcher import LaunchError
from components.train import checkpoint as ckpt
from components.train.data import DataFitError
from components.train.precision import PrecisionError
from components.train.report import read_records
from components.train.resume import ResumeError, _decide

TWO_NODES = ["cluster.nodes=2", "cluster.procs_per_node=1"]


def events(run_dir: Path, kind: str) -> list[dict]:
    return [e for e in read_records(run_dir / "metrics.jsonl")[1] if e["kind"] == kind]


def test_two_node_fp8_with_activation_checkpointing(trainer, capfd):
    r = trainer.run(
        *TWO_NODES,
        "train.precision=fp8",
        "train.activation_checkpointing=true",
        "train.steps=80",
        "train.checkpoint_interval=40",
    )
    out = capfd.readouterr().out
    assert "14 Float8Linear layers" in out and "kept in high precision: lm_head" in out
    assert "activation checkpointing on 2 of 2 blocks" in out
    steps, _ = read_records(r.run_dir / "metrics.jsonl")
    assert r.final_loss < 0.8 * steps[0]["loss"], (steps[0]["loss"], r.final_loss)
    assert [p.name for p in ckpt.local_checkpoints(r.run_dir / "checkpoints")] == ["step-80", "step-40"]
    assert ckpt.verify(r.run_dir / "checkpoints" / "step-80")["step"] == 80
    from transformers import AutoModelForCausalLM, AutoTokenizer

    export = Path(r.result["export_dir"])
    model = AutoModelForCausalLM.from_pretrained(str(export))
    tok = AutoTokenizer.from_pretrained(str(export))
    ids = torch.tensor([tok.encode("In the beginning")])
    assert torch.isfinite(model(ids).logits).all()
    stored = trainer.store.resolve("model", "tiny", r.identity)
    assert any(p.startswith("checkpoint/tiny@") for p in stored.parents)
    assert trainer.store.exists(ckpt_ref(r.checkpoint_version))


def ckpt_ref(version: str):
    from components.store import Ref

    return Ref("checkpoint", "tiny", version)


def final_weights(run) -> dict[str, torch.Tensor]:
    return load_file(str(Path(run.result["export_dir"]) / "model.safetensors"))


def test_killed_rank_resumes_to_identical_weights(dataset_store, tmp_path):
    from tests.conftest import Trainer

    common = [*TWO_NODES, "train.steps=30", "train.checkpoint_interval=10", "cluster.max_restarts=1"]
    clean = Trainer(dataset_store, tmp_path / "clean").run(*common)
    killed = Trainer(dataset_store, tmp_path / "killed").run(
        *common, "train.faults.kill_rank=1", "train.faults.kill_step=15"
    )
    starts = events(killed.run_dir, "start")
    assert len(starts) == 2 and starts[1]["step"] == 10 and starts[1]["resumed_from"].endswith("step-10")
    a, b = final_weights(clean), final_weights(killed)
    assert a.keys() == b.keys()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6


def test_corrupt_newest_checkpoint_falls_back_and_partial_save_is_ignored(trainer, caplog):
    r = trainer.run("train.steps=20", "train.checkpoint_interval=10", "train.checkpoint_keep=3")
    root = r.run_dir / "checkpoints"
    shard = next((root / "step-20").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # truncated
    partial = root / "step-30.tmp"  # what a process killed mid-save leaves
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"half")
    caplog.set_level("WARNING")
    cfg = trainer.config("train.steps=20")
    # auto: local first; the store holds the good step-20 too, so look only at the local choice
    chosen = _decide("auto", root, _EmptyStore(), cfg.model, r.identity)
    assert chosen == root / "step-10"
    assert "step-20" in caplog.text and shard.name in caplog.text and "truncated" in caplog.text


class _EmptyStore:
    description = "empty store"

    def versions(self, kind, name):
        return []


def test_resume_auto_continues_from_the_store(trainer):
    first = trainer.run("train.steps=20", "train.checkpoint_interval=10")
    import shutil

    shutil.rmtree(first.run_dir)  # a new pod: nothing local, the store has the checkpoints
    again = trainer.run("train.steps=20", "train.checkpoint_interval=10")
    start = events(again.run_dir, "start")[-1]
    assert start["step"] == 20 and again.identity == first.identity


def test_nan_batches_are_skipped_named_and_rolled_back(trainer):
    r = trainer.run(
        "train.steps=16", "train.checkpoint_interval=10", "train.faults.nan_steps=[5,12,13,14]", "train.max_bad_steps=3"
    )
    bad = events(r.run_dir, "nonfinite_step")
    assert [e["step"] for e in bad] == [5, 12, 13, 14]
    assert all(e["first_nonfinite_module"] == "model.embed_tokens" for e in bad)
    assert bad[-1]["skipped_total"] == 4 and r.result["skipped_steps"] == 4
    rollback = events(r.run_dir, "rollback")
    assert len(rollback) == 1 and rollback[0]["step"] == 14 and rollback[0]["to"] == "step-10"
    assert all(s["stepped"] for s in read_records(r.run_dir / "metrics.jsonl")[0] if s["step"] in (15, 16))


def test_slow_rank_is_reported_and_hang_trips_the_watchdog(trainer, capfd):
    start = time.monotonic()
    with pytest.raises(LaunchError) as err:
        trainer.run(
            *TWO_NODES,
            "train.steps=30",
            "train.straggler_interval=4",
            "train.faults.slow_rank=1",
            "train.faults.slow_seconds=0.3",
            "train.faults.hang_rank=1",
            "train.faults.hang_step=9",
            "train.watchdog_timeout_s=8",
        )
    assert time.monotonic() - start < 120
    message = str(err.value)
    assert "Thread 0x" in message and "most recent call first" in message  # the stacks, in the error
    assert "watchdog: no training progress" in capfd.readouterr().out
    run_dir = next((trainer.tmp / "runs").iterdir())
    slow = events(run_dir, "straggler")
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


def test_resume_from_checkpoint_of_another_shape_fails_before_launch(trainer):
    r = trainer.run("train.steps=10", "train.checkpoint_interval=10")
    with pytest.raises(ResumeError, match="another model shape: .*num_layers=2 there vs 3 here"):
        trainer.run("train.steps=10", f"train.resume={r.checkpoint_version}", "model.num_layers=3")


def test_metrics_jsonl_has_the_monitoring_fields(trainer):
    r = trainer.run("train.steps=6", "train.warmup_steps=2", "train.peak_tflops=0.1")
    steps, evs = read_records(r.run_dir / "metrics.jsonl")
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
    assert list((r.run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert json.loads((r.run_dir / "result.json").read_text())["steps"] == 6


def test_fsdp_bf16_async_checkpoints_on_two_nodes(trainer):
    from components.config import EvalConfig
    from components.validate.stage import run_validate

    r = trainer.run(
        *TWO_NODES,
        "train.parallelism=fsdp",
        "train.precision=bf16",
        "train.checkpoint_async=true",
        "train.activation_checkpointing=true",
        "train.steps=30",
        "train.checkpoint_interval=10",
    )
    steps, _ = read_records(r.run_dir / "metrics.jsonl")
    assert r.final_loss < 0.9 * steps[0]["loss"]
    kept = ckpt.local_checkpoints(r.run_dir / "checkpoints")
    assert [c.name for c in kept] == ["step-30", "step-20"] and all(ckpt.verify(c) for c in kept)
    # the FSDP-sharded checkpoint and the gathered HF export hold the same weights
    verdict = run_validate(str(r.model.ref), EvalConfig(loss_tolerance=1.0), trainer.store)
    assert verdict.numbers["checkpoint_max_abs_diff"] == 0.0
