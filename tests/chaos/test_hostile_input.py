"""Hostile input: random overrides and store keys, bad bytes in datasets, files crafted to run
code on load."""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from components.config import compose, defaults
from components.plots import read_records
from components.store import InvalidKey, open_store
from components.tokenize.documents import DataError
from components.tokenize.stage import run_tokenize
from pipelines.cli import main

KEYS = [
    "train.lr",
    "train.steps",
    "model",
    "model.hidden_size",
    "data.paths",
    "cluster.nodes",
    "store.backend",
    "train.precision",
    "eval.prompts",
    "preflight.floors",
    "nonexistent.key",
    "+new",
    "~train",
    "train",
]
VALUES = st.one_of(
    st.text(max_size=12),
    st.integers(-(10**6), 10**6).map(str),
    st.sampled_from(
        ["[]", "[1,2", "{a: 1}", "null", "${oc.env:HOME}", "${nope}", "1e400", "fp8", "'", "\\", "a,b", "=="]
    ),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from(KEYS), value=VALUES)
def test_any_override_is_success_or_one_clear_line(key, value, capsys):
    rc = main(["config", f"{key}={value}"])
    captured = capsys.readouterr()
    assert rc in (0, 2)
    assert "Traceback" not in captured.err
    if rc == 2:
        assert len(captured.err.strip().splitlines()) == 1 and captured.err.startswith("liftoff config: ")


PART = st.text(alphabet=st.characters(codec="utf-8"), min_size=0, max_size=12)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=PART, name=PART, version=PART, rel=st.lists(PART, min_size=1, max_size=3).map("/".join))
def test_any_store_key_is_refused_or_stays_inside_the_root(tmp_path_factory, kind, name, version, rel):
    base = tmp_path_factory.mktemp("keys")
    store = open_store(defaults("store", root=str(base / "root"), cache_dir=str(base / "root" / ".cache")))
    src = base / "src"
    src.mkdir()
    (src / "f.txt").write_text("x")
    try:
        store.publish(kind, name, version, src)
    except InvalidKey:
        pass
    try:
        store.backend.put_bytes(f"{kind}/{name}/{version}/{rel}", b"payload")
    except (InvalidKey, OSError):
        pass
    outside = [p for p in base.rglob("*") if not (p.is_relative_to(base / "root") or p.is_relative_to(src))]
    assert outside == [], outside


HOSTILE = st.one_of(
    st.sampled_from(["..", "../..", "../escape", "/tmp/escape", "a/../../escape", "\x00", "a\x00b", "step/../..", ""]),
    st.text(alphabet=st.sampled_from(["a", ".", "/", "\x00", "\\", "-"]), max_size=10),
)


def resume_from_rewritten_manifest(base: Path, rel: str | None, step) -> None:
    """Publish a checkpoint, rewrite its manifest (an extra file named `rel`, the step), resume
    from it: it must be refused, and nothing may land outside the store root, cache and
    checkpoint directory."""
    import json

    from components.checkpoint_fetch import fetch_head
    from components.checkpoint_format import CheckpointError
    from components.store import IntegrityError, Ref, StoreError

    store = open_store(defaults("store", root=str(base / "root"), cache_dir=str(base / "cache")))
    src = base / "src"
    src.mkdir()
    (src / "checkpoint.json").write_text('{"files": {}, "meta": {}}')
    store.publish("checkpoint", "tiny", "v-step1", src, metadata={"step": 1})
    manifest_path = base / "root" / Ref("checkpoint", "tiny", "v-step1").prefix / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    if rel is not None:
        manifest["files"][rel] = manifest["files"]["checkpoint.json"]
    manifest["metadata"]["step"] = step
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises((StoreError, IntegrityError, CheckpointError)):
        fetch_head(store, base / "ckpts", store.manifest(Ref("checkpoint", "tiny", "v-step1")))
    allowed = (base / "root", base / "cache", base / "ckpts", src)
    outside = [p for p in base.parent.rglob("*") if p.is_relative_to(base) is False and "escape" in p.name]
    outside += [p for p in base.rglob("*") if not any(p.is_relative_to(a) for a in allowed)]
    assert outside == [], outside


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rel=HOSTILE.filter(lambda r: r not in ("checkpoint.json",)))
def test_hostile_file_names_in_a_manifest_are_refused(tmp_path_factory, rel):
    resume_from_rewritten_manifest(tmp_path_factory.mktemp("names"), rel, 1)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(step=st.one_of(HOSTILE, st.integers(-3, -1), st.floats(allow_nan=True), st.none(), st.booleans()))
def test_hostile_checkpoint_steps_in_a_manifest_are_refused(tmp_path_factory, step):
    resume_from_rewritten_manifest(tmp_path_factory.mktemp("steps"), None, step)


def tokenize(tmp_path: Path, src: Path, *overrides: str):
    cfg = OmegaConf.to_object(compose([f"data.paths=[{src}]", "data.seq_len=8", *overrides]))
    store = open_store(defaults("store", root=str(tmp_path / "store"), cache_dir=str(tmp_path / "cache")))
    return run_tokenize(cfg.data, cfg.tokenizer, cfg.model, store), store


def test_invalid_utf8_in_a_dataset_is_a_clear_error(tmp_path, chaos):
    rec = chaos("dataset file with invalid UTF-8", "a clear error naming the file, nothing published")
    src = tmp_path / "bad.jsonl"
    src.write_bytes(b'{"text": "fine document"}\n{"text": "bad \xff\xfe bytes"}\n')
    with pytest.raises(DataError, match="cannot parse .*bad.jsonl") as err:
        tokenize(tmp_path, src)
    assert not (tmp_path / "store").exists() or not list((tmp_path / "store").rglob("manifest.json"))
    rec.happened(str(err.value)[:90])


def test_empty_file_is_a_clear_error(tmp_path, chaos):
    rec = chaos("0-byte dataset file", "a clear error, nothing published")
    src = tmp_path / "empty.txt"
    src.write_bytes(b"")
    with pytest.raises(DataError) as err:
        tokenize(tmp_path, src)
    assert "no usable documents" in str(err.value) or "cannot parse" in str(err.value)
    rec.happened(str(err.value)[:90])


@pytest.mark.parametrize(
    "size_mb,limit",
    [
        pytest.param(80, 64 * 2**20, id="80MB"),
        pytest.param(1024, 64 * 2**20, id="1GB"),  # ~5 s: writing the file is most of it
    ],
)
def test_a_huge_single_line_is_refused_while_streaming(tmp_path, chaos, size_mb, limit):
    rec = chaos(f"a {size_mb} MB single-line text file", "refused while streaming, never loaded whole")
    src = tmp_path / "oneline.txt"
    block = b"a" * (1 << 20)
    with open(src, "wb") as f:
        for _ in range(size_mb):
            f.write(block)
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        with pytest.raises(DataError, match="a line longer than data.max_doc_bytes"):
            tokenize(tmp_path, src, f"data.max_doc_bytes={limit}")
    finally:
        src.unlink()  # pytest keeps the last runs' tmp dirs: no GB left behind
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mb < 64  # streamed in 1 MB chunks
    rec.happened(f"refused; peak memory grew {grown_mb:.0f} MB")


class _Exploit:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def tiny_checkpoint(ckpt_dir: Path, lr=None):
    """A real (single-process) checkpoint of a tiny model and its optimizer in `ckpt_dir`, as
    `checkpoint.load` reads one (`lr`, if given, replaces the stored param group's: DCP keeps it
    as a pickled bytes item); returns a fresh model and optimizer to load it into."""
    import json

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    if lr is not None:
        optim_sd["param_groups"][0]["lr"] = lr
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(ckpt_dir), no_dist=True)
    (ckpt_dir / "meta.json").write_text(json.dumps({"step": 1}))
    fresh = torch.nn.Linear(3, 2)
    return fresh, torch.optim.AdamW(fresh.parameters())


def torch_saved(path: Path, obj) -> bytes:
    """`obj` as torch.save writes it (the format of a real rank{r}.pt): pickling an _Exploit
    only records its __reduce__, nothing runs."""
    import torch

    torch.save(obj, path)
    return path.read_bytes()


def test_files_crafted_to_run_code_on_load_are_refused(tmp_path, chaos):
    import torch

    from components.checkpoint_format import CheckpointError, read_metadata_safely
    from components.hf import ModelLoadError, load_hf_model
    from components.train import checkpoint

    rec = chaos(
        "checkpoint metadata, rank state and model weights crafted to run code when unpickled",
        "refused; the payload never runs",
    )
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Exploit(marker))
    (tmp_path / ".metadata").write_bytes(payload)
    with pytest.raises(CheckpointError, match=r"\.metadata: refusing to load checkpoint metadata"):
        read_metadata_safely(tmp_path / ".metadata")
    ckpt_dir = tmp_path / "step-1"
    model, optimizer = tiny_checkpoint(ckpt_dir)
    crafted = {"torch.save": torch_saved(ckpt_dir / "crafted.pt", {"rng": _Exploit(marker)}), "raw pickle": payload}
    for kind, data in crafted.items():
        (ckpt_dir / "rank0.pt").write_bytes(data)
        with pytest.raises((pickle.UnpicklingError, CheckpointError)):
            try:
                checkpoint.load(ckpt_dir, model, optimizer, rank=0)  # what a resuming rank calls
            finally:
                assert not marker.exists(), f"checkpoint.load ran the code in a {kind} rank0.pt"
    # the payload is live: a plain torch.load of that rank state runs it
    probe = Path(f"{marker}-probe")
    torch_saved(ckpt_dir / "rank0.pt", {"rng": _Exploit(probe)})
    torch.load(ckpt_dir / "rank0.pt", weights_only=False)
    assert probe.exists()
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"model_type": "llama"}')
    (model_dir / "pytorch_model.bin").write_bytes(payload)
    with pytest.raises(ModelLoadError, match="pickled weights are refused"):
        load_hf_model(model_dir)
    assert not marker.exists()
    rec.happened("metadata unpickler, checkpoint.load of rank state and safetensors-only loading all refused it")


def stack_global_payload(module: str, name: str, command: str) -> bytes:
    """A protocol-4 pickle that calls `module`.`name`(command): STACK_GLOBAL resolves a dotted
    `name` attribute by attribute, so ("...filesystem", "os.system") reaches os.system through
    a module that imports os."""

    def text(s: str) -> bytes:
        raw = s.encode()
        return b"\x8c" + bytes([len(raw)]) + raw  # SHORT_BINUNICODE

    return b"\x80\x04" + text(module) + text(name) + b"\x93" + text(command) + b"\x85R."  # STACK_GLOBAL, TUPLE1, REDUCE


def tamper(store_root: Path, ref, rel: str, data: bytes) -> None:
    """Replace one file of a stored checkpoint and update every hash that covers it, as anyone
    with write access to the bucket can: the checkpoint's own index and the store manifest."""
    import hashlib
    import json

    version_dir = store_root / ref.prefix
    (version_dir / rel).write_bytes(data)
    index = json.loads((version_dir / "checkpoint.json").read_text())
    index["files"][rel] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    (version_dir / "checkpoint.json").write_text(json.dumps(index))
    manifest = json.loads((version_dir / "manifest.json").read_text())
    for name in (rel, "checkpoint.json"):
        body = (version_dir / name).read_bytes()
        manifest["files"][name] = {"sha256": hashlib.sha256(body).hexdigest(), "size": len(body)}
    (version_dir / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.chaos_slow  # 40 s, a training run and a resume: in `make chaos`, out of `make test`
def test_code_in_stored_checkpoint_metadata_never_runs(dataset_store, tmp_path, chaos, capfd):
    import subprocess
    import sys

    from components.checkpoint_format import ALLOWED_GLOBALS
    from components.launcher import LaunchError
    from components.store import Ref
    from components.validate.checks import ValidationFailed
    from components.validate.stage import run_validate
    from tests.conftest import Trainer

    rec = chaos(
        "stored checkpoint's DCP metadata replaced by a pickle that runs a command through a dotted name "
        "(and through every module the unpickler allows), every hash updated",
        "resume and validate refuse it naming the file; the command never runs",
    )
    trainer = Trainer(dataset_store, tmp_path / "t")
    run = ["train.steps=4", "train.warmup_steps=1", "train.checkpoint_interval=4"]
    trained = trainer.run(*run)
    ckpt = Ref("checkpoint", "tiny", trained.checkpoint_version)
    marker = tmp_path / "pwned"
    dotted = stack_global_payload("torch.distributed.checkpoint.filesystem", "os.system", f"touch {marker}-probe")
    # the payload is live: plain pickle runs it
    subprocess.run([sys.executable, "-c", "import pickle, sys; pickle.loads(sys.stdin.buffer.read())"], input=dotted)
    assert Path(f"{marker}-probe").exists()

    modules = sorted({module for module, _ in ALLOWED_GLOBALS}) + ["os", "posix", "subprocess"]
    variants = [(m, name) for m in modules for name in ("os.system", "system", "__builtins__.exec")]
    for module, name in variants:
        tamper(Path(trainer.store_cfg.root), ckpt, ".metadata", stack_global_payload(module, name, f"touch {marker}"))
        with pytest.raises(ValidationFailed, match=r"\.metadata.*refus"):
            run_validate(str(trained.model.ref), defaults("eval", loss_tolerance=10.0), trainer.store)
        shutil.rmtree(trainer.store_cfg.cache_dir, ignore_errors=True)
    assert not marker.exists()

    shutil.rmtree(trained.run_dir)  # a new pod: resume must come from the store
    capfd.readouterr()
    longer = ["train.steps=8", "train.warmup_steps=1", "train.checkpoint_interval=4"]
    with pytest.raises(LaunchError, match=r"\.metadata.*refus"):
        trainer.run(*longer, f"train.resume={trained.checkpoint_version}")
    quarantined = trainer.store.quarantined(ckpt)  # refused once, never offered again
    assert quarantined and ".metadata" in quarantined["reason"] and not trainer.store.exists(ckpt)
    again = trainer.run(*run)  # auto: the tampered checkpoint is no candidate
    assert again.result.steps == 4 and again.result.resumed_from is None
    starts = [e for e in read_records(again.metrics)[1] if e["kind"] == "start"]
    assert starts[-1]["step"] == 0  # trained afresh, never loaded the crafted metadata
    assert not marker.exists()
    rec.happened(
        f"{len(variants)} payloads (dotted names through {len(modules)} modules): validate, resume=<version> and "
        "resume=auto all refused naming .metadata (the version quarantined); no command ran"
    )


class _RunsACommand:
    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def test_code_in_a_checkpoint_shards_bytes_items_never_runs(tmp_path, chaos):
    """DCP keeps non-tensor state (optimizer param groups) as pickled bytes inside the shards and
    loads them with torch.load(weights_only=False); a shard crafted to hold code (its .metadata
    clean) must be refused where the train resume and validate load it."""
    import torch
    import torch.distributed.checkpoint as dcp

    from components.checkpoint_format import CheckpointError, load_state
    from components.train import checkpoint
    from components.validate.checks import ValidationFailed, load_checkpoint_weights

    rec = chaos(
        "checkpoint shard whose bytes items (optimizer state, a weight) hold a pickle that runs a command",
        "refused on load naming the item; the command never runs",
    )
    marker = tmp_path / "pwned"
    crafted = tmp_path / "crafted"
    payload = _RunsACommand(f"touch {marker}")
    dcp.save({"model": {"w": payload}, "optim": {"param_groups": payload}}, checkpoint_id=str(crafted), no_dist=True)

    class Model:
        def state_dict(self):
            return {"w": torch.zeros(2)}

    with pytest.raises(ValidationFailed, match="refusing to load model.w"):
        load_checkpoint_weights(crafted, Model())
    with pytest.raises(CheckpointError, match="refusing to load optim.param_groups"):
        load_state({"optim": {"param_groups": []}}, crafted, no_dist=True)
    assert not marker.exists()
    # what a resuming rank calls reads the shards through the same safe loader
    model, optimizer = tiny_checkpoint(tmp_path / "step-1", lr=payload)
    with pytest.raises(CheckpointError, match="refusing to load optim.param_groups.0.lr"):
        try:
            checkpoint.load(tmp_path / "step-1", model, optimizer, rank=0)
        finally:
            assert not marker.exists(), "checkpoint.load ran the code in an optimizer param group"
    # the payload is live: DCP's own loader runs it
    dcp.load({"optim": {"param_groups": []}}, checkpoint_id=str(crafted), no_dist=True)
    assert marker.exists()
    rec.happened(
        "a weight and the optimizer's param groups as code: refused by SafeLoadPlanner (validate, load_state, "
        "checkpoint.load); no command ran"
    )
