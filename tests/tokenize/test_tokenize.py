"""The tokenize stage on the shipped corpus and on bad input."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import numpy as np
import pytest
from omegaconf import OmegaConf

from components.blocks import BlockWriter, load_tokenizer, open_token_blocks
from components.config import compose, defaults
from components.store import open_store
from components.tokenize import stage
from components.tokenize.documents import DataError
from components.tokenize.pack import block_dtype
from tests.conftest import CORPUS


def cfg_for(tmp: Path, *overrides: str):
    cfg = OmegaConf.to_object(compose([f"data.paths=[{CORPUS}]", *overrides]))
    cfg.store = defaults("store", root=str(tmp / "store"), cache_dir=str(tmp / "cache"))
    return cfg


def tokenize(cfg):
    return stage.run_tokenize(cfg.data, cfg.tokenizer, cfg.model, open_store(cfg.store))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cfg = cfg_for(tmp_path_factory.mktemp("tok"))
    return cfg, tokenize(cfg)


def source_docs() -> list[str]:
    return [json.loads(line)["text"] for line in CORPUS.read_text().splitlines()]


def test_output_opens_with_datasets_and_round_trips_to_source(built):
    cfg, result = built
    dd = datasets.load_from_disk(str(result.path))
    assert set(dd) == {"train", "val"} and dd["val"].num_rows == result.stats["splits"]["val"]["blocks"]
    tok = load_tokenizer(result.path)
    sources = set(source_docs())
    for split in ("val", "train"):
        blocks = open_token_blocks(result.path, split)
        assert blocks.block_len == cfg.data.seq_len + 1 and blocks.dtype == np.uint16
        ids = np.concatenate([blocks[i] for i in range(len(blocks))]).tolist()
        docs, cur = [], []
        for t in ids:
            if t == tok.eos_token_id:
                docs.append(cur)
                cur = []
            else:
                cur.append(t)
        decoded = [tok.decode(d) for d in docs]  # every document up to the dropped tail, in full
        assert decoded and all(d in sources for d in decoded) and len(set(decoded)) == len(decoded)
        assert len(decoded) >= result.stats["splits"][split]["documents"] - 1


def test_splits_are_disjoint_by_document(built):
    _, result = built
    tok = load_tokenizer(result.path)
    texts = {}
    for split in ("train", "val"):
        b = open_token_blocks(result.path, split)
        flat = np.concatenate([b[i] for i in range(len(b))]).tolist()
        texts[split] = set(tok.decode(flat).split(tok.eos_token)[1:-1])
    assert texts["val"] and not texts["train"] & texts["val"]


def test_rerun_reuses_version_without_tokenizing(built, monkeypatch, caplog):
    cfg, first = built

    def boom(*a, **k):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(stage, "build_dataset", boom)
    caplog.set_level("INFO")
    again = tokenize(cfg)
    assert again.reused and again.manifest.ref == first.manifest.ref
    assert "reusing it, no tokenization" in caplog.text


def test_changing_seq_len_makes_a_new_version(built):
    cfg, first = built
    cfg.data.seq_len = 32
    other = tokenize(cfg)
    assert not other.reused and other.manifest.ref.version != first.manifest.ref.version
    assert open_token_blocks(other.path, "train").block_len == 33


def test_stats_count_drops_and_dedup(tmp_path):
    src = tmp_path / "d.jsonl"
    docs = [{"text": "hello world, this is a document."}] * 3 + [{"text": "   "}, {"text": ""}]
    docs += [{"text": f"another distinct document number {i} with words"} for i in range(40)]
    src.write_text("\n".join(json.dumps(d) for d in docs))
    cfg = cfg_for(tmp_path, f"data.paths=[{src}]", "data.seq_len=8", "data.val_fraction=0.2")
    stats = tokenize(cfg).stats
    assert stats["documents_in"] == 45
    assert stats["dropped"]["empty_or_short"] == 2 and stats["dropped"]["duplicate"] == 2
    assert stats["splits"]["train"]["documents"] + stats["splits"]["val"]["documents"] == 41


@pytest.mark.parametrize("fmt", ["txt", "parquet"])
def test_txt_and_parquet_sources(tmp_path, fmt):
    texts = [f"paragraph {i} of a plain text corpus with some words in it" for i in range(30)]
    if fmt == "txt":
        (tmp_path / "src").mkdir()
        (tmp_path / "src" / "a.txt").write_text("\n\n".join(texts))
    else:
        (tmp_path / "src").mkdir()
        datasets.Dataset.from_dict({"body": texts}).to_parquet(str(tmp_path / "src" / "a.parquet"))
    field = "text" if fmt == "txt" else "body"
    cfg = cfg_for(
        tmp_path,
        f"data.paths=[{tmp_path / 'src'}]",
        f"data.text_field={field}",
        "data.seq_len=8",
        "data.val_fraction=0.2",
    )
    result = tokenize(cfg)
    assert result.stats["documents_in"] == 30 and len(open_token_blocks(result.path, "val")) >= 1


def test_block_dtype_is_smallest_sufficient():
    assert block_dtype(1024) == np.uint16 and block_dtype(65536) == np.uint16
    assert block_dtype(65537) == np.uint32 and block_dtype(128256) == np.uint32


def test_reader_random_access_across_chunks(tmp_path):
    datasets.Dataset.from_dict({"x": [1]}).save_to_disk(str(tmp_path / "unused"))
    arrow = tmp_path / "blocks.arrow"
    w = BlockWriter(arrow, 5, np.dtype(np.uint16))
    expected = np.arange(5 * 23, dtype=np.uint16).reshape(23, 5)
    for part in np.array_split(expected, 4):
        w(part)
    w.close()
    datasets.DatasetDict({"train": datasets.Dataset.from_file(str(arrow))}).save_to_disk(str(tmp_path / "ds"))
    blocks = open_token_blocks(tmp_path / "ds", "train")
    assert len(blocks) == 23
    for i in np.random.default_rng(0).permutation(23):
        np.testing.assert_array_equal(blocks[i], expected[i])
    np.testing.assert_array_equal(blocks[-1], expected[-1])
    with pytest.raises(IndexError):
        blocks[23]
    with pytest.raises(FileNotFoundError, match="no split 'test'"):
        open_token_blocks(tmp_path / "ds", "test")


def published(cfg) -> list:
    return list(open_store(cfg.store).ls())


def bad(tmp_path: Path, *overrides: str, match: str):
    cfg = cfg_for(tmp_path, *overrides)
    with pytest.raises(DataError, match=match):
        tokenize(cfg)
    assert published(cfg) == []


def test_missing_path(tmp_path):
    bad(tmp_path, f"data.paths=[{tmp_path / 'nope.jsonl'}]", match="nope.jsonl does not exist")


def test_unreadable_file(tmp_path):
    link = tmp_path / "mem.jsonl"
    link.symlink_to("/proc/self/mem")  # exists and opens, but reading it fails (works as root too)
    bad(tmp_path, f"data.paths=[{link}]", match="cannot read .*mem.jsonl")


def test_missing_text_column_lists_columns(tmp_path):
    bad(tmp_path, "data.text_field=body", match=r"column 'body' not in the data; it has \['text', 'source'\]")


def test_zero_usable_documents(tmp_path):
    src = tmp_path / "blank.jsonl"
    src.write_text('{"text": "  "}\n{"text": ""}\n')
    bad(tmp_path, f"data.paths=[{src}]", match="no usable documents: 2 read")


def test_seq_len_too_large_for_one_val_block(tmp_path):
    bad(
        tmp_path,
        "data.seq_len=16384",
        "model.max_seq_len=16384",
        "data.val_fraction=0.01",
        match="data.seq_len=16384: the val split has .* tokens, fewer than one block",
    )


def test_tokenizer_vocab_exceeds_model(tmp_path):
    bad(tmp_path, "tokenizer.vocab_size=2048", "model.vocab_size=1000", match="more than model.vocab_size=1000")


def test_unparseable_file(tmp_path):
    src = tmp_path / "broken.jsonl"
    src.write_text('{"text": "ok"}\n{not json\n')
    bad(tmp_path, f"data.paths=[{src}]", match="cannot parse")


def test_kfp_component_runs_under_kfp_local(tmp_path):
    import kfp.local

    from components.config import group_dicts
    from components.tokenize.component import tokenize as tokenize_component

    kfp.local.init(runner=kfp.local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "root"))
    groups = group_dicts(
        compose([f"data.paths=[{CORPUS}]", f"store.root={tmp_path / 'store'}", f"store.cache_dir={tmp_path / 'cache'}"])
    )
    task = tokenize_component(
        data=groups["data"], tokenizer=groups["tokenizer"], model=groups["model"], store=groups["store"]
    )
    ref = task.outputs["Output"]
    assert ref.startswith("dataset/kjv@")
    art = task.outputs["dataset"]
    assert art.metadata["ref"] == ref and art.metadata["val_blocks"] > 0
    assert json.loads(Path(art.path).read_text())["ref"] == ref
