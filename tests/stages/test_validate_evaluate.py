"""Validate and evaluate on a model trained on the shipped corpus."""

from __future__ import annotations

import shutil
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from components.config import defaults
from components.evaluate.stage import EvalInputError, run_evaluate
from components.hf import ModelLoadError, load_hf_model
from components.store import ArtifactStore, Ref, sha256_file
from components.validate.checks import ValidationFailed
from components.validate.stage import run_validate
from tests.conftest import Trainer


@pytest.fixture(scope="module")
def trained(dataset_store, tmp_path_factory):
    trainer = Trainer(dataset_store, tmp_path_factory.mktemp("trained"))
    result = trainer.run("train.steps=60")
    return trainer, str(result.model.ref)


def copy_store(trainer: Trainer, tmp_path: Path) -> ArtifactStore:
    """A private copy of the store, so a test may damage it."""
    from components.store import open_store

    shutil.copytree(trainer.store_cfg.root, tmp_path / "store")
    return open_store(defaults("store", root=str(tmp_path / "store"), cache_dir=str(tmp_path / "cache")))


def test_good_model_passes_every_check(trained):
    trainer, ref = trained
    verdict = run_validate(ref, defaults("eval"), trainer.store)
    assert set(verdict.checks) == {
        "model_hashes",
        "checkpoint_hashes",
        "loads_with_transformers",
        "checkpoint_matches_export",
        "forward_finite",
        "loss_agrees",
    }
    assert verdict.numbers["checkpoint_max_abs_diff"] == 0.0
    # the fp32 model recomputed from the store matches what the live model measured in training
    assert verdict.numbers["loss_gap"] < 1e-5
    # it read the checkpoint's weights, verified, and not one byte of its optimizer state
    ckpt_ref = next(p for p in trainer.store.manifest(Ref.parse(ref)).parents if p.startswith("checkpoint/"))
    stored = trainer.store.manifest(Ref.parse(ckpt_ref))
    assert {"__0_0.distcp", "__0_1.distcp"} <= set(stored.files)  # the weights, the optimizer state
    (read,) = (Path(trainer.store_cfg.cache_dir) / stored.ref.prefix).glob("step-*")
    assert sha256_file(read / "__0_0.distcp") == stored.files["__0_0.distcp"]["sha256"]
    assert not list(Path(trainer.store_cfg.cache_dir).rglob("__0_1.distcp"))  # nowhere in the cache


def test_a_model_that_is_not_what_training_measured_fails_the_loss_check(trained, tmp_path):
    """The stored weights (export and checkpoint agreeing) against the loss the live model had
    at the end of training: a model whose recorded probe loss differs fails, naming the gap."""
    import json

    trainer, ref = trained
    store = copy_store(trainer, tmp_path)
    manifest_path = tmp_path / "store" / Ref.parse(ref).prefix / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["metadata"]["probe_loss"] += 0.2
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(ValidationFailed, match=r"loss check: .* first 8 val blocks .* eval.loss_tolerance=0.05"):
        run_validate(ref, defaults("eval"), store)


def test_flipped_byte_in_safetensors_fails_naming_the_file(trained, tmp_path):
    trainer, ref = trained
    store = copy_store(trainer, tmp_path)
    version_dir = tmp_path / "store" / Ref.parse(ref).prefix
    weights = version_dir / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))
    with pytest.raises(Exception, match="model.safetensors"):
        run_validate(ref, defaults("eval"), store)


def test_flipped_byte_in_the_local_copy_is_caught_too(trained, tmp_path):
    trainer, ref = trained
    store = copy_store(trainer, tmp_path)
    local = store.fetch(store.manifest(Ref.parse(ref)))
    weights = local / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(ValidationFailed, match="model.safetensors: sha256 does not match"):
        run_validate(ref, defaults("eval"), store)


def republish_changed(trained, tmp_path, version: str, change, keep_metadata: bool):
    """A copy of the store where model/tiny@`version` is the trained model with `change` applied
    to its exported tensors, published with the original's parents (and metadata)."""
    trainer, ref = trained
    store = copy_store(trainer, tmp_path)
    manifest = store.manifest(Ref.parse(ref))
    bad = tmp_path / version
    shutil.copytree(store.fetch(manifest), bad, ignore=shutil.ignore_patterns(".liftoff-verified"))
    tensors = load_file(str(bad / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    metadata = manifest.metadata if keep_metadata else None
    store.publish("model", "tiny", version, bad, parents=manifest.parents, metadata=metadata)
    return store


def test_nan_weights_fail_the_forward_check(trained, tmp_path):
    def nan_norm(tensors):
        tensors["model.norm.weight"] = torch.full_like(tensors["model.norm.weight"], float("nan"))

    store = republish_changed(trained, tmp_path, "nan-weights", nan_norm, keep_metadata=False)
    with pytest.raises(ValidationFailed, match="checkpoint .* and model .* weights differ|non-finite logits"):
        run_validate("model/tiny@nan-weights", defaults("eval"), store)


@pytest.mark.parametrize("change", ["finite", "nan"])
def test_an_exported_weight_unlike_the_checkpoint_fails_the_export_check(trained, tmp_path, change):
    """One element of one exported tensor changed (by 1e-3, or to NaN) in a republished model:
    the exact DCP == export comparison names it; a NaN must not slip past it to the later checks."""
    name = "model.layers.0.mlp.down_proj.weight"

    def one_element(tensors):
        weight = tensors[name].clone()
        weight.view(-1)[7] = weight.view(-1)[7] + 1e-3 if change == "finite" else float("nan")
        tensors[name] = weight

    store = republish_changed(trained, tmp_path, f"changed-{change}", one_element, keep_metadata=True)
    with pytest.raises(ValidationFailed, match=rf"checkpoint .* and model .* weights differ in 1 tensor.*{name}"):
        run_validate(f"model/tiny@changed-{change}", defaults("eval"), store)


def test_model_dir_without_config_is_a_clear_error(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_hf_model(tmp_path)


class _Collect(HTMLParser):
    def __init__(self):
        super().__init__()
        self.imgs, self.cells, self.in_td = [], [], False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "img":
            self.imgs.append(attrs)
        self.in_td = tag == "td"

    def handle_data(self, data):
        if self.in_td:
            self.cells.append(data)


def test_evaluate_beats_unigram_and_reports(trained):
    trainer, ref = trained
    result = run_evaluate(
        ref, defaults("eval", val_blocks=32, prompts=["In the beginning"], max_new_tokens=8), trainer.store
    )
    m = result.metrics
    from components.config import EVAL_METRICS

    assert set(m) <= set(EVAL_METRICS), set(m) - set(EVAL_METRICS)  # what eval.objective may name
    assert m["val_perplexity"] < m["unigram_perplexity"], m
    assert 0 < m["val_bits_per_byte"] < 8 and m["inference_tokens_per_s"] > 0
    assert result.samples[0]["prompt"] == "In the beginning" and result.samples[0]["continuation"]
    page = _Collect()
    page.feed(result.html)
    curves = [i for i in page.imgs if i.get("class") == "curve"]
    assert len(curves) == 6 and all(i["src"].startswith("data:image/png;base64,iVBOR") for i in curves)
    assert result.report_path.name == "report.html" and result.report_path.read_text() == result.html
    assert ref in result.html and "code version" in result.html  # the identity header
    for name, value in m.items():
        assert name in page.cells and f"{value:.6g}" in page.cells
    stored = trainer.store.resolve("eval", "tiny", result.manifest.ref.version)
    assert ref in stored.parents and any(p.startswith("dataset/") for p in stored.parents)


def test_evaluate_with_baseline_reports_deltas(trained):
    """Against another model (fewer steps, another seed), evaluated on its own as the reference."""
    trainer, ref = trained
    weaker = str(trainer.run("train.steps=8", "train.warmup_steps=2", "train.seed=1").model.ref)
    alone = run_evaluate(weaker, defaults("eval", val_blocks=8, prompts=[]), trainer.store)
    result = run_evaluate(ref, defaults("eval", val_blocks=8, prompts=[], baseline=weaker), trainer.store)
    assert result.metrics["baseline_val_loss"] == pytest.approx(alone.metrics["val_loss"])
    assert result.metrics["val_loss"] < result.metrics["baseline_val_loss"]  # 60 steps beat 8
    assert "delta vs baseline" in result.html


def test_unknown_lm_eval_task_is_a_clear_error(trained):
    trainer, ref = trained
    with pytest.raises(EvalInputError, match=r"unknown lm-eval task\(s\) \['no_such_task_xyz'\]"):
        run_evaluate(ref, defaults("eval", lm_eval_tasks=["no_such_task_xyz"]), trainer.store)


def test_zero_val_blocks_is_a_clear_error(trained, tmp_path):
    """A dataset version (published by another tool, say) whose shards list no val block."""
    import copy

    from components.evaluate.stage import measure

    trainer, ref = trained
    store = copy_store(trainer, tmp_path)
    model = store.manifest(Ref.parse(ref))
    data = store.manifest(Ref.parse(next(p for p in model.parents if p.startswith("dataset/"))))
    meta = copy.deepcopy(data.metadata)
    meta["stats"]["splits"]["val"]["blocks"] = 0
    for shard in meta["shards"]:
        shard["splits"]["val"]["blocks"] = 0
    empty = store.publish("dataset", "empty-val", "v1", store.fetch(data), metadata=meta, parents=data.parents)
    with pytest.raises(EvalInputError, match="val split has zero blocks"):
        measure(store.fetch(model), store, empty, defaults("eval"))


@pytest.mark.parametrize("backend", ["local", "minio"])
def test_a_damaged_stored_model_is_quarantined_and_the_rerun_exports_it_again(trained, tmp_path, backend, request):
    """One flipped byte in the stored model.safetensors: validate quarantines the version and says
    so; the rerun's train stage (same identity: it resumes at its final step and trains no step)
    publishes the same weights under the same version again, and validate passes."""
    import uuid

    from components.config import StoreBackend
    from components.store import open_store
    from tests.conftest import Trainer

    trainer, ref = trained
    rerun = Trainer(trainer.dataset_store, tmp_path / "rerun")
    if backend == "minio":
        request.getfixturevalue("s3_env")
        cfg = defaults("store", backend=StoreBackend.minio, bucket=f"t-{uuid.uuid4().hex[:12]}", root="",
                       cache_dir=str(tmp_path / "cache"), timeout_s=10.0)  # fmt: skip
    else:
        cfg = defaults("store", root=str(tmp_path / "store"), cache_dir=str(tmp_path / "cache"))
    store = open_store(cfg)
    source = Path(trainer.store_cfg.root)
    for path in sorted(p for p in source.rglob("*") if p.is_file()):
        store.backend.put_file(path.relative_to(source).as_posix(), path)
    rerun.store_cfg, rerun.store = cfg, store
    key = f"{Ref.parse(ref).prefix}/model.safetensors"
    data = bytearray(store.backend.get_bytes(key))
    data[len(data) // 2] ^= 0x01
    store.backend.put_bytes(key, bytes(data))

    with pytest.raises(ValidationFailed, match=r"model.safetensors.*quarantined it: rerun to re-export it"):
        run_validate(ref, defaults("eval"), store)
    assert not store.exists(Ref.parse(ref)) and store.quarantined(Ref.parse(ref)) is not None

    again = rerun.run("train.steps=60")
    assert again.result.start_step == 60  # resumed at the final checkpoint: re-exported, not retrained
    assert str(again.model.ref) == ref and store.quarantined(Ref.parse(ref)) is None
    assert store.backend.get_bytes(key) != bytes(data)  # the stored bytes are the export's again
    verdict = run_validate(ref, defaults("eval"), store)
    assert verdict.checks["model_hashes"] and verdict.checks["loss_agrees"]
