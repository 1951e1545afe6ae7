"""Hostile input: random overrides and store keys, bad bytes in datasets, files crafted to run
code on load."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from components.config import StoreConfig, compose
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
    store = open_store(StoreConfig(root=str(base / "root"), cache_dir=str(base / "root" / ".cache")))
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


def tokenize(tmp_path: Path, src: Path, *overrides: str):
    cfg = OmegaConf.to_object(compose([f"data.paths=[{src}]", "data.seq_len=8", *overrides]))
    store = open_store(StoreConfig(root=str(tmp_path / "store"), cache_dir=str(tmp_path / "cache")))
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
        pytest.param(1024, 64 * 2**20, id="1GB", marks=pytest.mark.chaos_slow),
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
    with pytest.raises(DataError, match="a line longer than data.max_doc_bytes"):
        tokenize(tmp_path, src, f"data.max_doc_bytes={limit}")
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mb < 64  # streamed in 1 MB chunks
    rec.happened(f"refused; peak memory grew {grown_mb:.0f} MB")


class _Exploit:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_files_crafted_to_run_code_on_load_are_refused(tmp_path, chaos):
    import torch

    from components.train.checkpoint import CheckpointError, _MetadataUnpickler
    from components.validate.checks import ValidationFailed, load_hf_model

    rec = chaos(
        "checkpoint metadata, rank state and model weights crafted to run code when unpickled",
        "refused; the payload never runs",
    )
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Exploit(marker))
    import io

    with pytest.raises(CheckpointError, match="refusing to load checkpoint metadata: it references"):
        _MetadataUnpickler(io.BytesIO(payload)).load()
    (tmp_path / "rank0.pt").write_bytes(payload)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(tmp_path / "rank0.pt", weights_only=True)  # how checkpoint.load reads rank state
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"model_type": "llama"}')
    (model_dir / "pytorch_model.bin").write_bytes(payload)
    with pytest.raises(ValidationFailed, match="pickled weights are refused"):
        load_hf_model(model_dir)
    assert not marker.exists()
    rec.happened("metadata unpickler, weights_only load and safetensors-only loading all refused it")
