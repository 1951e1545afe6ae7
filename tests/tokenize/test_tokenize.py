"""The tokenize stage on the shipped corpus and on bad input."""

from __future__ import annotations

import json
import re
from pathlib import Path

import datasets
import numpy as np
import pytest
from omegaconf import OmegaConf

from components.blocks import BlockWriter, ShardFile, load_tokenizer
from components.config import compose, defaults
from components.store import Ref, open_store
from components.stream import open_split
from components.tokenize import plan as plan_module
from components.tokenize import shard as shard_module
from components.tokenize import stage
from components.tokenize.pack import block_dtype
from components.tokenize.sources import DataError
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


def blocks_of(cfg, result, split):
    return open_split(open_store(cfg.store), result.manifest, split)


def data_dir(cfg, result) -> Path:
    return open_store(cfg.store).fetch(result.manifest)  # the version itself: tokenizer and stats


def test_output_opens_with_datasets_and_round_trips_to_source(built):
    cfg, result = built
    st = open_store(cfg.store)
    (only,) = result.manifest.metadata["shards"]
    shard_dir = st.fetch(Ref.parse(only["ref"]))
    for split in ("train", "val"):  # each shard file is an Arrow file `datasets` opens as it is
        ds = datasets.Dataset.from_file(str(shard_dir / f"{split}.arrow"))
        assert ds.num_rows == result.stats["splits"][split]["blocks"] == only["splits"][split]["blocks"]
    tok = load_tokenizer(data_dir(cfg, result))
    sources = set(source_docs())
    for split in ("val", "train"):
        blocks = blocks_of(cfg, result, split)
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
    cfg, result = built
    tok = load_tokenizer(data_dir(cfg, result))
    texts = {}
    for split in ("train", "val"):
        b = blocks_of(cfg, result, split)
        flat = np.concatenate([b[i] for i in range(len(b))]).tolist()
        texts[split] = set(tok.decode(flat).split(tok.eos_token)[1:-1])
    assert texts["val"] and not texts["train"] & texts["val"]


def test_rerun_reuses_version_without_tokenizing(built, monkeypatch, caplog):
    cfg, first = built

    def boom(*a, **k):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(shard_module, "build_shard", boom)
    monkeypatch.setattr(plan_module, "train_bpe", boom)
    caplog.set_level("INFO")
    again = tokenize(cfg)
    assert again.reused and again.manifest.ref == first.manifest.ref
    assert "reusing it, no tokenization" in caplog.text


def test_changing_seq_len_makes_a_new_version(built):
    cfg, first = built
    cfg.data.seq_len = 32
    other = tokenize(cfg)
    assert not other.reused and other.manifest.ref.version != first.manifest.ref.version
    assert blocks_of(cfg, other, "train").block_len == 33


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
    assert result.stats["documents_in"] == 30 and len(blocks_of(cfg, result, "val")) >= 1


def test_block_dtype_is_smallest_sufficient():
    assert block_dtype(1024) == np.uint16 and block_dtype(65536) == np.uint16
    assert block_dtype(65537) == np.uint32 and block_dtype(128256) == np.uint32


def test_shard_file_random_access_across_chunks(tmp_path):
    arrow = tmp_path / "blocks.arrow"
    w = BlockWriter(arrow, 5, np.dtype(np.uint16))
    expected = np.arange(5 * 23, dtype=np.uint16).reshape(23, 5)
    for part in np.array_split(expected, 4):
        w(part)
    w.close()
    blocks = ShardFile(arrow, 5)
    assert len(blocks) == 23
    for i in np.random.default_rng(0).permutation(23):
        np.testing.assert_array_equal(blocks[i], expected[i])
    with pytest.raises(IndexError):
        blocks[23]
    with pytest.raises(ValueError, match="expected column 'input_ids' of 7-token blocks"):
        ShardFile(arrow, 7)
    (tmp_path / "junk.arrow").write_bytes(b"not arrow at all")
    with pytest.raises(ValueError, match="is not an Arrow block file"):
        ShardFile(tmp_path / "junk.arrow", 5)


def published(cfg, kind: str | None = None) -> list:
    return list(open_store(cfg.store).ls(kind))


def bad(tmp_path: Path, *overrides: str, match: str, error=DataError):
    """A clear error, and no dataset version stored (the plan's tokenizer and any shard that
    was built may be: a retry reuses them)."""
    cfg = cfg_for(tmp_path, *overrides)
    with pytest.raises(error, match=match):
        tokenize(cfg)
    assert published(cfg, "dataset") == []
    return cfg


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
    bad(tmp_path, f"data.paths=[{src}]", match="no usable training documents: 2 read")


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


@pytest.mark.parametrize(
    "name,content,reason",
    [
        pytest.param(
            "bad.jsonl",
            b'{"text": "a"}\n{"text": "b"}\n{"text": "c" "d"}\n{"text": "e"}\n',
            " line 3: not valid JSON (Expecting ',' delimiter: column 14)",
            id="not-json",
        ),
        pytest.param("empty.jsonl", b"", ": empty file, no documents", id="empty-jsonl"),
        pytest.param("empty.txt", b"", ": empty file, no documents", id="empty-txt"),
        pytest.param("blank.jsonl", b"\n  \n\n", ": only blank lines, no documents", id="blank-lines"),
        pytest.param(
            "image.jsonl",
            b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x01\x00",
            " line 1: not UTF-8 (byte 0x89 at offset 0)",
            id="binary",
        ),
        pytest.param(
            "latin1.jsonl",
            '{"text": "fine"}\n{"text": "caf\xe9 au lait"}\n'.encode("latin-1"),
            " line 2: not UTF-8 (byte 0xe9 at offset 13)",
            id="latin-1-jsonl",
        ),
        pytest.param(
            "latin1.txt",
            "In the beginning\n\ncaf\xe9\n".encode("latin-1"),
            " line 3: not UTF-8 (byte 0xe9 at offset 3)",
            id="latin-1-text",
        ),
        pytest.param(
            "cut.jsonl",
            b'{"text": "a"}\n{"text": "b"}\n{"text": "cut off',
            " line 3: not valid JSON (Unterminated string starting at: column 10)",
            id="bad-last-line",
        ),
        pytest.param(
            "typed.jsonl",
            b'{"text": "a", "n": 1}\n\n{"text": "b", "n": "two"}\n',
            " line 3: 'n' is a string; line 1 has a number",
            id="type-change",
        ),
    ],
)
def test_a_parse_error_names_the_file_the_line_and_the_reason(tmp_path, name, content, reason):
    """Through the whole stage (the plan reads the documents first, for the BPE's sample):
    the message is the file, the line and what the parser found, never datasets' own
    "An error occurred while generating the dataset"."""
    src = tmp_path / name
    src.write_bytes(content)
    cfg = cfg_for(tmp_path, f"data.paths=[{src}]")
    with pytest.raises(DataError) as err:
        tokenize(cfg)
    assert str(err.value) == f"data.paths: cannot parse {src.resolve()}{reason}"
    assert published(cfg, "dataset") == []


def test_parquet_errors_name_the_file_and_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from components.tokenize.documents import load_documents

    data = defaults("data")
    notpq = tmp_path / "text.parquet"
    notpq.write_text("In the beginning God created the heaven and the earth.\n")
    with pytest.raises(DataError) as err:
        load_documents(data, [notpq])
    assert str(err.value) == (
        f"data.paths: cannot parse {notpq}: not a Parquet file (Parquet magic bytes not found in footer. "
        "Either the file is corrupted or this is not a parquet file.)"
    )
    latin1 = tmp_path / "latin1.parquet"  # string bytes Parquet writes unchecked
    pq.write_table(pa.table({"text": pa.array([b"one", b"two", b"caf\xe9"], pa.binary()).view(pa.string())}), latin1)
    with pytest.raises(DataError) as err:
        load_documents(data, [latin1], names=["s3://corpus/latin1.parquet"])
    assert (
        str(err.value) == "data.paths: cannot parse s3://corpus/latin1.parquet row 3: not UTF-8 (byte 0xe9 at offset 3)"
    )


def test_a_line_over_max_doc_bytes_is_refused_naming_its_line(tmp_path):
    src = tmp_path / "long.jsonl"
    src.write_text('{"text": "short"}\n' * 3 + json.dumps({"text": "x" * 5000}) + "\n")
    cfg = cfg_for(tmp_path, f"data.paths=[{src}]", "data.max_doc_bytes=4096")
    with pytest.raises(DataError) as err:
        tokenize(cfg)
    assert str(err.value) == (
        f"data.paths: {src.resolve()} has a line longer than data.max_doc_bytes=4096 (line 4); split it into "
        "documents or raise the limit"
    )


def test_plan_shards_and_merge_fan_out_under_kfp_local(tmp_path, capfd):
    """The stage as the pipeline wires it: plan -> dsl.ParallelFor over its items -> merge of the
    dsl.Collected shard refs, run by kfp.local, each task a process of its own; run again on a
    wiped store, every shard is tokenized again."""
    import shutil

    import kfp.local
    from kfp import dsl

    from components.config import group_dicts
    from components.tokenize.component import tokenize_merge, tokenize_plan, tokenize_shard
    from pipelines.local import print_kept
    from tests.conftest import split_corpus

    corpus = split_corpus(tmp_path / "corpus", parts=3)
    runner = kfp.local.SubprocessRunner(use_venv=False)
    kfp.local.init(runner=runner, pipeline_root=str(tmp_path / "root"), enable_caching=True)  # as `liftoff run`
    overrides = [f"data.paths=[{corpus}]", "data.shards=3", f"store.root={tmp_path / 'store'}"]
    groups = group_dicts(compose([*overrides, f"store.cache_dir={tmp_path / 'cache'}"]))

    def fan_out(data, tokenizer, model, store):
        planned = tokenize_plan(data=data, tokenizer=tokenizer, model=model, store=store)
        planned.set_caching_options(False)  # as pipelines/pretrain.py: the plan always runs
        with dsl.ParallelFor(planned.outputs["Output"], parallelism=2) as item:
            shard = tokenize_shard(shard=item, store=store)
        merged = tokenize_merge(
            shards=dsl.Collected(shard.output),
            plan=planned.outputs["plan"],
            data=data,
            tokenizer=tokenizer,
            store=store,
        )
        return merged.outputs["Output"]

    # real types, not this module's postponed (string) annotations, for KFP's signature reading
    fan_out.__annotations__ = {"data": dict, "tokenizer": dict, "model": dict, "store": dict, "return": str}
    fan_out = dsl.pipeline(fan_out)
    with print_kept():  # kfp.local's threads can leave builtins.print indenting for later tests
        ref = fan_out(**{g: groups[g] for g in ("data", "tokenizer", "model", "store")}).output
    assert ref.startswith("dataset/kjv@")
    # the store wiped, kfp.local's cache kept: the plan is committed anew, so no shard task is
    # answered by the cache (with a ref to a shard the store no longer holds); same dataset version
    shutil.rmtree(tmp_path / "store")
    capfd.readouterr()
    with print_kept():
        assert fan_out(**{g: groups[g] for g in ("data", "tokenizer", "model", "store")}).output == ref
    said = re.sub(r"\x1b\[[0-9;]*m", "", capfd.readouterr().out)  # kfp.local's lines, uncoloured
    assert said.count("Executing task 'tokenize-shard'") == 3 and "cache hit" not in said, said
    stored = open_store(defaults("store", root=str(tmp_path / "store"), cache_dir=str(tmp_path / "c2")))
    manifest = stored.manifest(Ref.parse(ref))
    version = manifest.ref.version
    assert [s["ref"] for s in manifest.metadata["shards"]] == [f"shard/kjv@{version}-{i}of3" for i in range(3)]
    for i, entry in enumerate(manifest.metadata["shards"]):  # each shard read its own file of the source
        (source,) = stored.manifest(Ref.parse(entry["ref"])).metadata["sources"]
        assert source["relpath"] == f"part-{i:02d}.jsonl"
